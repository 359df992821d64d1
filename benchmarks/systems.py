"""The systems under test, each behind the same small interface.

Every system saves the same state (see `state.py`) and loads it back into
the saved sharding and into a different one. Settings follow each library's
documentation for performance; `settings()` reports them into the results.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from . import state as st


def _compression() -> Any:
    """cairn's `compression=` for this run (`python -m benchmarks.run --compression`): "auto" by default."""
    c = os.environ.get("CAIRN_BENCH_COMPRESSION", "auto")
    return {"true": True, "false": False}.get(c, c)


class System:
    name = ""
    reshards = True  # can load into a different sharding than it saved

    def setup(self) -> None: ...

    def settings(self) -> dict[str, Any]:
        return {}

    def build(self, spec: list[st.Leaf], dtype: str) -> tuple[Any, dict[str, str]]:
        return st.build_jax(spec, dtype)

    def save(self, state: Any, path: str) -> None:
        raise NotImplementedError

    def save_async(self, state: Any, path: str) -> Any:
        """Start a save; return a handle `wait` accepts."""
        raise NotImplementedError

    def wait(self, handle: Any) -> None:
        raise NotImplementedError

    def load(self, path: str, spec: list[st.Leaf], dtype: str, resharded: bool) -> Any:
        raise NotImplementedError

    def check(self, loaded: Any, prints: dict[str, str], spec: list[st.Leaf], resharded: bool) -> None:
        st.check_jax(loaded, prints, resharded, spec)

    def close(self) -> None: ...


# ---------------------------------------------------------------------- cairn


class Cairn(System):
    name = "cairn"

    def setup(self) -> None:
        import cairn

        self.cairn = cairn

    def settings(self) -> dict[str, Any]:
        import inspect

        sig = inspect.signature(self.cairn.save).parameters
        lsig = inspect.signature(self.cairn.load).parameters
        return {
            "version": getattr(self.cairn, "__version__", "?"),
            "save": f"cairn.save(path, state) (threads={sig['threads'].default}, compression={_compression()!r})",
            "async": "cairn.save_async(path, state).result()",
            "load": f"cairn.load(path, abstract ShapeDtypeStruct tree with sharding) (threads={lsig['threads'].default}, verify=True)",
        }

    def save(self, state: Any, path: str) -> None:
        self.cairn.save(path, state, compression=_compression())

    def save_async(self, state: Any, path: str) -> Any:
        return self.cairn.save_async(path, state, compression=_compression())

    def wait(self, handle: Any) -> None:
        handle.result()

    def load(self, path: str, spec: list[st.Leaf], dtype: str, resharded: bool) -> Any:
        import jax

        out = self.cairn.load(path, st.abstract_jax(spec, dtype, resharded))
        return jax.block_until_ready(out)


class CairnCompressed(Cairn):
    """cairn with `compression=True` whatever the run's `--compression`: beside "cairn" in one run
    (``--systems cairn,cairn_compressed``), compression on against the run's setting, interleaved."""

    name = "cairn_compressed"

    def settings(self) -> dict[str, Any]:
        out = super().settings()
        out["save"] = out["save"].replace(f"compression={_compression()!r}", "compression=True")
        return out

    def save(self, state: Any, path: str) -> None:
        self.cairn.save(path, state, compression=True)

    def save_async(self, state: Any, path: str) -> Any:
        return self.cairn.save_async(path, state, compression=True)


# ---------------------------------------------------------------------- Orbax


class Orbax(System):
    """orbax-checkpoint: AsyncCheckpointer over PyTreeCheckpointHandler, OCDBT + zarr3.

    This is what `ocp.StandardCheckpointer` is, with zarr3 switched on as
    Orbax's performance guide recommends (0.12's handler still defaults to
    zarr2); compression, concurrency limits and file sizes keep their defaults.
    """

    name = "orbax"

    def setup(self) -> None:
        import logging

        import orbax.checkpoint as ocp

        logging.getLogger("absl").setLevel(logging.WARNING)
        self.ocp = ocp
        self.ckptr = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True))

    def settings(self) -> dict[str, Any]:
        from importlib.metadata import version

        return {
            "version": version("orbax-checkpoint"),
            "tensorstore": version("tensorstore"),
            "save": "ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True))"
                    ".save(path, args=ocp.args.PyTreeSave(state)); wait_until_finished() "
                    "(compression and concurrency at their defaults)",
            "async": "same save(); return time = save() returning, commit = wait_until_finished()",
            "load": "restore(path, args=ocp.args.PyTreeRestore(item=abstract, "
                    "restore_args=checkpoint_utils.construct_restore_args(abstract)))",
        }

    def save(self, state: Any, path: str) -> None:
        self.ckptr.save(path, args=self.ocp.args.PyTreeSave(state))
        self.ckptr.wait_until_finished()

    def save_async(self, state: Any, path: str) -> Any:
        self.ckptr.save(path, args=self.ocp.args.PyTreeSave(state))
        return self.ckptr

    def wait(self, handle: Any) -> None:
        handle.wait_until_finished()

    def load(self, path: str, spec: list[st.Leaf], dtype: str, resharded: bool) -> Any:
        import jax

        abstract = st.abstract_jax(spec, dtype, resharded)
        restore_args = self.ocp.checkpoint_utils.construct_restore_args(abstract)
        out = self.ckptr.restore(path, args=self.ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args))
        return jax.block_until_ready(out)

    def close(self) -> None:
        self.ckptr.close()


# ---------------------------------------------------------------------- PyTorch DCP


class DCP(System):
    """torch.distributed.checkpoint in one process (gloo, world size 1).

    One process holds whole tensors, so there is no other sharding to load
    into: the resharding rows are not applicable to DCP here.
    """

    name = "dcp"
    reshards = False
    threads = 8

    def setup(self) -> None:
        import tempfile

        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.torch, self.dist, self.dcp = torch, dist, dcp
        self._store = tempfile.mktemp(prefix="cairn-bench-gloo-")
        dist.init_process_group("gloo", init_method=f"file://{self._store}", rank=0, world_size=1)

    def settings(self) -> dict[str, Any]:
        return {
            "version": self.torch.__version__,
            "save": f"dcp.save(state_dict, storage_writer=FileSystemWriter(path, thread_count={self.threads}, "
                    "single_file_per_rank=True, sync_files=True)), gloo world size 1",
            "async": "dcp.async_save(same writer).result() (default thread executor and stager)",
            "load": "dcp.load(preallocated torch.empty state_dict, storage_reader=FileSystemReader(path))",
        }

    def build(self, spec: list[st.Leaf], dtype: str) -> tuple[Any, dict[str, str]]:
        return st.build_torch(spec, dtype)

    def _writer(self, path: str) -> Any:
        return self.dcp.FileSystemWriter(path, thread_count=self.threads, single_file_per_rank=True, sync_files=True)

    def save(self, state: Any, path: str) -> None:
        self.dcp.save(state, storage_writer=self._writer(path))

    def save_async(self, state: Any, path: str) -> Any:
        return self.dcp.async_save(state, storage_writer=self._writer(path))

    def wait(self, handle: Any) -> None:
        fut = getattr(handle, "upload_completion", handle)
        fut.result()

    def load(self, path: str, spec: list[st.Leaf], dtype: str, resharded: bool) -> Any:
        torch = self.torch
        def tdtype(leaf: st.Leaf) -> Any:
            d = st.leaf_dtype(leaf, dtype)
            return torch.bfloat16 if d == st.np_dtype("bfloat16") else getattr(torch, d.name)

        sd = st.nest({leaf.name: torch.empty(leaf.shape, dtype=tdtype(leaf)) for leaf in spec})
        self.dcp.load(sd, storage_reader=self.dcp.FileSystemReader(path))
        return sd

    def check(self, loaded: Any, prints: dict[str, str], spec: list[st.Leaf], resharded: bool) -> None:
        flat = st.unnest(loaded)
        for leaf in spec:
            got = st.fingerprint(st.torch_to_numpy(flat[leaf.name]))
            if got != prints[leaf.name]:
                raise AssertionError(f"{leaf.name}: loaded values differ")

    def close(self) -> None:
        self.dist.destroy_process_group()
        try:
            os.unlink(self._store)
        except OSError:
            pass


class DCPBesideJAX(DCP):
    """DCP, measured in a process that also holds the benchmark's JAX state.

    On the benchmark VM the first touch of a fresh page costs ~5x more
    kernel time while a JAX state is alive in the process than in a process
    that holds only torch tensors, whoever allocates the page
    (docs/PERFORMANCE.md, "Why DCP's first staging copy is faster"). cairn's
    first async save always runs beside a JAX state and DCP's worker never
    does, so `dcp` compares the two processes as much as the two libraries.
    This system builds the JAX state first and keeps it alive, then does
    exactly what `dcp` does: the same-conditions comparison. Its peak RSS
    figures include the JAX state it holds (one more state size).
    """

    name = "dcp_jax"

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "process": "also holds the JAX state (built first, alive throughout)"}

    def build(self, spec: list[st.Leaf], dtype: str) -> tuple[Any, dict[str, str]]:
        self._held = st.build_jax(spec, dtype)[0]
        return super().build(spec, dtype)

    def close(self) -> None:
        self._held = None
        super().close()


SYSTEMS: dict[str, type[System]] = {"cairn": Cairn, "cairn_compressed": CairnCompressed, "orbax": Orbax, "dcp": DCP, "dcp_jax": DCPBesideJAX}


# ---------------------------------------------------------------------- physical limits

_PIECE = 64 << 20


def raw_write(buf: np.ndarray, path: str) -> float:
    """One file, large positional writes, one fsync: the storage write limit."""
    mv = memoryview(buf.reshape(-1).view(np.uint8))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        while off < len(mv):
            off += os.pwrite(fd, mv[off : off + _PIECE], off)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def raw_write_parallel(buf: np.ndarray, paths: list[str]) -> float:
    """The same bytes split over len(paths) files, one thread each, each fsync'd."""
    from concurrent.futures import ThreadPoolExecutor

    flat = buf.reshape(-1).view(np.uint8)
    parts = np.array_split(flat, len(paths))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(paths)) as pool:
        list(pool.map(raw_write, parts, paths))
    return time.perf_counter() - t0


def raw_read_parallel(paths: list[str], sizes: list[int]) -> float:
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(paths)) as pool:
        list(pool.map(raw_read, paths, sizes))
    return time.perf_counter() - t0


def raw_read(path: str, nbytes: int) -> tuple[float, np.ndarray]:
    """Sequential large reads into a freshly allocated buffer: the storage read limit."""
    t0 = time.perf_counter()
    out = np.empty(nbytes, dtype=np.uint8)
    mv = memoryview(out)
    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        while off < nbytes:
            got = os.preadv(fd, [mv[off : off + _PIECE]], off)
            if got == 0:
                raise EOFError(path)
            off += got
    finally:
        os.close(fd)
    return time.perf_counter() - t0, out


def memcpy_fresh(src: np.ndarray) -> tuple[float, np.ndarray]:
    """Copy into newly allocated memory (page faults included), as a snapshot must."""
    t0 = time.perf_counter()
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return time.perf_counter() - t0, dst


def memcpy_hot(src: np.ndarray, dst: np.ndarray) -> float:
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0
