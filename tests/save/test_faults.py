"""Kill anywhere: SIGKILL a saving process before every I/O operation of a save or of retention.

A *fork server* (a child interpreter that has imported cairn and numpy, but
not JAX, and runs no threads of its own) forks one short-lived process per
trial. The trial process patches the storage layer's operations so that each
one first counts itself, and kills itself with SIGKILL just before operation
`k`:

- local disk: every ``os.write`` (one per chunk: between data writes),
  ``os.fsync`` (before and after each fsync), ``os.mkdir``, ``os.rename``,
  ``os.replace``, ``os.link`` (the manifest's create-if-absent), ``os.unlink``
  and ``os.rmdir`` (retention and cleanup deletes, one file at a time), and
  the ``renameat2(RENAME_EXCHANGE)`` that swaps an overwritten checkpoint;
- object storage (S3 on moto's server, Azure Blob on Azurite, both on
  127.0.0.1): every ``obstore.put`` (data files, indexes, the manifest's
  create-if-absent put), every part handed to a multipart upload, and every
  ``obstore.delete`` batch. (GCS skips: fake-gcs-server takes no write.)

A counting run first lists the operations of the scenario; then every `k`
from 0 to that count is tried (``k == count`` is the run that completes).
After each kill the test, in this process, checks the guarantees: the latest
committed checkpoint loads bitwise equal to one of the saved states, nothing
uncommitted is visible, cleanup succeeds and leaves no temporary files, and
the next save succeeds.

``CAIRN_STRESS=1`` repeats each scenario with larger states (more chunks and
files, so more kill points).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

import cairn
from _trees import assert_same
from cairn._cli import main as _cli

STRESS = os.environ.get("CAIRN_STRESS") == "1"
pytestmark = pytest.mark.timeout(600)

# The trial process. Shared with this module (exec'd below) for `make_state`.
SERVER = textwrap.dedent(
    r'''
    import json, os, re, signal, sys, threading
    import numpy as np
    import cairn

    def make_state(tag, scale=1):
        """The state saved under `tag`: arrays of several dtypes, a scalar, a string, bytes."""
        rng = np.random.default_rng(1000 + tag)
        return {
            "params": {f"w{i}": rng.standard_normal((16 * scale, 8)).astype(np.float32) for i in range(3)}
            | {"emb": rng.integers(-9, 9, (8, 4 * scale), dtype=np.int32)},
            "opt": {"mu": rng.standard_normal(32 * scale), "count": np.int64(tag)},
            "meta": {"step": tag, "name": f"state-{tag}", "blob": rng.bytes(40)},
        }

    def _norm(text, base):
        text = text.replace(base, "<dir>")
        text = re.sub(r"[0-9a-f]{12}", "<tok>", text)
        text = re.sub(r"del-[0-9a-f]{8}", "del-<tok>", text)
        return re.sub(r"\.tmp-\d+-[0-9a-f]+", ".tmp-<n>", text)

    def install(kill_at, log_fd, base):
        """Count the storage operations under `base`; SIGKILL this process before number `kill_at`."""
        lock = threading.Lock()
        ops = []
        raw_write = os.write

        def hit(label):
            with lock:
                k = len(ops)
                ops.append(_norm(label, base))
                if k == kill_at:
                    raw_write(log_fd, (json.dumps({"k": k, "op": ops[-1]}) + "\n").encode())
                    os.kill(os.getpid(), signal.SIGKILL)

        def fd_path(fd):
            try:
                return os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return ""

        def path_of(p, dir_fd=None):
            p = os.fsdecode(p) if not isinstance(p, int) else fd_path(p)
            return os.path.join(fd_path(dir_fd), p) if dir_fd is not None else p

        def wrap_fd(name):
            real = getattr(os, name)

            def f(fd, *a, **kw):
                p = fd_path(fd)
                if p.startswith(base + "/") or p == base:
                    hit(f"{name}({p})")
                return real(fd, *a, **kw)
            setattr(os, name, f)

        def wrap_path(name, nargs):
            real = getattr(os, name)

            def f(*a, **kw):
                paths = [path_of(x, kw.get("dir_fd", kw.get("src_dir_fd"))) for x in a[:nargs]]
                if name == "mkdir" and os.path.isdir(paths[0]):
                    return real(*a, **kw)  # fails with EEXIST, changes nothing: not an operation
                if any(p.startswith(base + "/") or p == base for p in paths):
                    hit(f"{name}({', '.join(paths)})")
                return real(*a, **kw)
            setattr(os, name, f)

        wrap_fd("write")
        wrap_fd("fsync")
        for name in ("mkdir", "unlink", "rmdir"):
            wrap_path(name, 1)
        for name in ("rename", "replace", "link"):
            wrap_path(name, 2)
        from cairn._storage import local as _local
        real_x = _local._rename_exchange

        def exchange(a, b):
            hit(f"renameat2_exchange({a}, {b})")
            return real_x(a, b)
        _local._rename_exchange = exchange

        try:
            import obstore
            from cairn._storage import obstore as _obstore
        except ImportError:
            return ops
        real_put, real_delete = obstore.put, obstore.delete

        def put(store, key, data, **kw):
            hit(f"store.put({key}, mode={kw.get('mode', 'overwrite')})")
            return real_put(store, key, data, **kw)

        def delete(store, keys):
            hit(f"store.delete({sorted(keys) if isinstance(keys, list) else keys})")
            return real_delete(store, keys)
        obstore.put, obstore.delete = put, delete
        real_write = _obstore.ObjectStorage.write

        def write(self, key, parts):
            def counted():
                for i, p in enumerate(parts):
                    hit(f"store.part({key}#{i})")
                    yield p
            return real_write(self, key, counted())
        _obstore.ObjectStorage.write = write
        return ops

    def scenario(spec):
        path, opts = spec["path"], spec.get("storage_options")
        if spec["kind"] == "save":
            cairn.save(path, make_state(spec["tag"], spec["scale"]), overwrite=spec["overwrite"],
                       storage_options=opts)
        elif spec["kind"] == "manager":
            with cairn.CheckpointManager(path, max_to_keep=spec["keep"], async_save=spec["async"],
                                         handle_sigterm=False, storage_options=opts) as mgr:
                mgr.save(spec["tag"], make_state(spec["tag"], spec["scale"]))
        else:
            raise ValueError(spec["kind"])

    def trial(spec, log_fd):
        if spec.get("no_exchange"):
            # A filesystem without renameat2(RENAME_EXCHANGE): the overwrite falls back.
            from cairn._storage import local as _local

            def no_exchange(a, b):
                raise OSError(38, "renameat2 is not available (test)")
            _local._rename_exchange = no_exchange
        ops = install(spec["kill_at"], log_fd, spec["base"])
        scenario(spec)
        cairn.wait_all()
        os.write(log_fd, (json.dumps({"done": ops}) + "\n").encode())

    def serve():
        for line in sys.stdin:
            spec = json.loads(line)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                code = 0
                try:
                    trial(spec, w)
                except BaseException as e:
                    os.write(w, (json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n").encode())
                    code = 3
                os._exit(code)
            os.close(w)
            with os.fdopen(r) as f:
                lines = [json.loads(x) for x in f.read().splitlines() if x.strip()]
            _, status = os.waitpid(pid, 0)
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            reply = {"signal": sig, "exit": os.WEXITSTATUS(status) if not sig else None}
            for x in lines:
                reply.update(x)
            print(json.dumps(reply), flush=True)

    if __name__ == "__main__":
        try:  # import here, once: the trial processes then only fork
            import obstore  # noqa: F401
            import cairn._storage.obstore  # noqa: F401
        except ImportError:
            pass
        import shutil, tempfile
        # Warm up (lazy imports, first-call costs) so that each trial only forks.
        warm = tempfile.mkdtemp()
        cairn.load(cairn.save(f"{warm}/c", make_state(0)) and f"{warm}/c")
        with cairn.CheckpointManager(warm, async_save=False, handle_sigterm=False) as m:
            m.save(0, make_state(0))
        shutil.rmtree(warm)
        # Forking is safe only without other threads (their locks would be copied held): the load's
        # reader threads, idle now, kept for the next load, are stopped.
        from cairn._load.engine import stop_threads
        stop_threads()
        assert threading.active_count() == 1, threading.enumerate()
        serve()
    '''
)

_shared: dict[str, Any] = {"__name__": "cairn_fault_server"}
exec(compile(SERVER, "<fault server>", "exec"), _shared)
make_state = _shared["make_state"]


class ForkServer:
    def __init__(self, tmp_path):
        script = tmp_path / "fault_server.py"
        script.write_text(SERVER)
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the fork server died"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ForkServer(tmp_path_factory.mktemp("forkserver"))
    yield s
    s.close()


# ---------------------------------------------------------------------- checks




def which_state(path: str, candidates: dict[int, Any], opts: dict | None = None) -> int | None:
    """The tag of the candidate the checkpoint at `path` equals bitwise, or None if not committed."""
    try:
        out = cairn.load(path, storage_options=opts)
    except cairn.CheckpointNotFoundError:
        return None
    tag = out["meta"]["step"]
    assert tag in candidates, f"{path} holds state {tag}, none of {sorted(candidates)}"
    assert_same(out, candidates[tag], path)
    return tag


def kill_points(server: ForkServer, spec: dict[str, Any], setup, stride: int = 1
                ) -> Iterator[tuple[int, dict[str, Any], str]]:
    """Count the scenario's operations, then yield one trial per kill point (and the completed run).

    With `stride` > 1 only every stride-th kill point is tried (and the completed run).
    """
    base = setup("count")
    count = server.run({**spec(base), "kill_at": -1})
    assert count.get("exit") == 0 and "done" in count, count
    ops = count["done"]
    assert ops, "the scenario did no counted operation"
    unreached = 0
    for k in range(len(ops) + 1):
        if k < len(ops) and k % stride:
            continue
        base = setup(f"k{k}")
        reply = server.run({**spec(base), "kill_at": k if k < len(ops) else -1})
        assert "error" not in reply, reply
        if reply["signal"]:
            assert reply["signal"] == signal.SIGKILL and reply["k"] == k, (k, ops[k], reply)
        else:
            assert reply.get("exit") == 0 and "done" in reply, reply
            # Threads racing (e.g. on creating a folder) may vary the count by one or two.
            unreached += k < len(ops)
        yield k, reply, ops[k] if k < len(ops) else "(completed)"
    assert unreached <= 2, f"{unreached} kill points were not reached: the operation count is unstable"


def copies_of(tmp_path, build):
    """A trial setup for local disk: `build` runs once; each trial gets a copy of its folder."""
    template = tmp_path / "template"
    template.mkdir()
    build(template)

    def setup(name: str) -> str:
        shutil.copytree(template, tmp_path / name, symlinks=True)
        return str(tmp_path / name)

    return setup


def local_leftovers(base: str) -> list[str]:
    """Temporary files and folders anywhere under `base`."""
    out = []
    for dirpath, dirs, files in os.walk(base):
        for n in dirs + files:
            if cairn._format.manifest.TMP_MARK in n or ".tmp-" in n:
                out.append(os.path.relpath(os.path.join(dirpath, n), base))
    return out


def gc(directory: str) -> None:
    """`cairn gc`: remove what interrupted saves left."""
    assert _cli.main(["--plain", "--quiet", "gc", "--min-age", "0", "--json", directory]) == 0


SCALES = [1, 4] if STRESS else [1]
REPORT: dict[str, int] = {}


def _record(name: str, trials: int, committed: int) -> None:
    REPORT[name] = trials
    print(f"\n{name}: {trials} kill points ({committed} left the new checkpoint committed)")


# ---------------------------------------------------------------------- local disk


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("mode", ["new", "overwrite", "overwrite-no-exchange"])
def test_kill_anywhere_local_save(server, tmp_path, mode, scale):
    old, new = make_state(1, scale), make_state(2, scale)

    def build(base):
        cairn.save(base / "prev", make_state(0, scale))
        if mode != "new":
            cairn.save(base / "ckpt", old)

    setup = copies_of(tmp_path, build)

    def spec(base):
        return {"kind": "save", "path": f"{base}/ckpt", "base": base, "tag": 2, "scale": scale,
                "overwrite": mode != "new", "no_exchange": mode == "overwrite-no-exchange"}

    outcomes = []
    stride = 3 if mode == "overwrite-no-exchange" and not STRESS else 1
    for k, _reply, op in kill_points(server, spec, setup, stride):
        base = str(tmp_path / f"k{k}")
        where = f"killed before op {k}: {op}"
        candidates = {2: new} if mode == "new" else {1: old, 2: new}
        got = which_state(f"{base}/ckpt", candidates)
        if mode != "new":
            assert got is not None, f"{where}: the overwritten checkpoint is gone"
        else:
            # Not committed: nothing at the checkpoint's path at all.
            assert got is not None or not os.path.exists(f"{base}/ckpt"), where
        assert_same(cairn.load(f"{base}/prev"), make_state(0, scale), where)
        outcomes.append(got)
        gc(base)
        assert local_leftovers(base) == [], (where, local_leftovers(base))
        assert sorted(os.listdir(base)) == ["ckpt", "prev"] if got is not None or mode != "new" else ["prev"]
        assert which_state(f"{base}/ckpt", candidates) == got, f"{where}: cleanup changed the checkpoint"
        cairn.save(f"{base}/ckpt", make_state(3, scale), overwrite=got is not None)
        assert which_state(f"{base}/ckpt", {3: make_state(3, scale)}) == 3, where
    assert outcomes[-1] == 2 and outcomes[0] == (None if mode == "new" else 1)
    _record(f"local save {mode} x{scale}", len(outcomes), sum(o == 2 for o in outcomes))


@pytest.mark.parametrize("use_async", [False, True])
def test_kill_anywhere_local_manager_retention(server, tmp_path, use_async):
    """Save step 2 with max_to_keep=2 over steps 0 and 1: the commit, then retention deletes step 0."""
    states = {s: make_state(s) for s in range(4)}

    def build(base):
        with cairn.CheckpointManager(base, max_to_keep=2, async_save=False, handle_sigterm=False) as mgr:
            for s in (0, 1):
                mgr.save(s, states[s])

    setup = copies_of(tmp_path, build)

    def spec(base):
        return {"kind": "manager", "path": base, "base": base, "tag": 2, "scale": 1, "keep": 2,
                "async": use_async}

    seen = set()
    n = 0
    for k, _reply, op in kill_points(server, spec, setup, 3 if use_async and not STRESS else 1):
        n += 1
        base = str(tmp_path / f"k{k}")
        where = f"killed before op {k}: {op}"
        with cairn.CheckpointManager(base, max_to_keep=2, async_save=False, handle_sigterm=False) as mgr:
            steps = mgr.steps()  # opening the manager cleaned up
            assert (set(steps) <= {0, 1, 2} and 1 in steps) or steps == [1, 2] or steps == [0, 1, 2], (where, steps)
            assert steps[-1] in (1, 2), where
            for s in steps:
                assert_same(mgr.restore(s), states[s], f"{where}: step {s}")
            assert local_leftovers(base) == [], (where, local_leftovers(base))
            assert sorted(os.listdir(base)) == [cairn._run.steps.step_dirname(s) for s in steps], where
            seen.add(tuple(steps))
            mgr.save(3, states[3])
            assert mgr.steps()[-2:] == [steps[-1], 3], where
            assert_same(mgr.restore(), states[3], where)
            assert local_leftovers(base) == [], where
    # The kills landed before the commit, between commit and retention, and after retention.
    assert {(0, 1), (0, 1, 2), (1, 2)} <= seen, seen
    _record(f"local manager {'async' if use_async else 'sync'} save + retention", n, 0)


# ---------------------------------------------------------------------- object storage (S3, Azure)


def store_leftovers(server, bucket: str, prefix: str) -> list[str]:
    """Objects under `prefix` that belong to no committed attempt (a token no manifest names)."""
    keys = server.keys(bucket, prefix)
    by_ckpt: dict[str, list[str]] = {}
    for k in keys:
        rest = k[len(prefix):]
        by_ckpt.setdefault(rest.split("/", 1)[0], []).append(rest)
    out = []
    for name, files in by_ckpt.items():
        if f"{name}/manifest.json" not in files:
            out.extend(files)
            continue
        manifest = json.loads(server.get_object(bucket, f"{prefix}{name}/manifest.json"))
        tokens = {re.search(r"index\.([0-9a-f]+)\.json", i["index"]).group(1) for i in manifest["items"].values()}
        out.extend(f for f in files if f != f"{name}/manifest.json" and not any(f".{t}." in f for t in tokens))
    return out


@pytest.mark.parametrize("mode", ["new", "overwrite"])
def test_kill_anywhere_object_store_save(server, objstore, mode):
    bucket = objstore.new_bucket("faults")
    opts = objstore.options()
    url = functools.partial(objstore.url, bucket)
    old, new = make_state(1), make_state(2)

    def setup(name):
        cairn.save(url(f"{name}/prev"), make_state(0), storage_options=opts)
        if mode != "new":
            cairn.save(url(f"{name}/ckpt"), old, storage_options=opts)
        return name

    def spec(name):
        return {"kind": "save", "path": url(f"{name}/ckpt"), "base": f"/nonexistent/{name}",
                "tag": 2, "scale": 1, "overwrite": mode != "new", "storage_options": opts}

    outcomes = []
    for k, _reply, op in kill_points(server, spec, setup):
        where = f"killed before op {k}: {op}"
        root = url(f"k{k}")
        candidates = {2: new} if mode == "new" else {1: old, 2: new}
        got = which_state(f"{root}/ckpt", candidates, opts)
        if mode != "new":
            assert got is not None, f"{where}: the overwritten checkpoint is gone"
        assert_same(cairn.load(f"{root}/prev", storage_options=opts), make_state(0), where)
        outcomes.append(got)
        # The next save succeeds over whatever was left, and leaves no stale objects behind.
        cairn.save(f"{root}/ckpt", make_state(3), overwrite=got is not None, storage_options=opts)
        assert which_state(f"{root}/ckpt", {3: make_state(3)}, opts) == 3, where
        assert store_leftovers(objstore, bucket, f"k{k}/") == [], where
    assert outcomes[-1] == 2 and outcomes[0] == (None if mode == "new" else 1)
    _record(f"{objstore.scheme} save {mode}", len(outcomes), sum(o == 2 for o in outcomes))


def test_kill_anywhere_object_store_manager_retention(server, objstore):
    bucket = objstore.new_bucket("faultsmgr")
    opts = objstore.options()
    url = functools.partial(objstore.url, bucket)
    states = {s: make_state(s) for s in range(4)}

    def setup(name):
        with cairn.CheckpointManager(url(name), max_to_keep=2, async_save=False,
                                     handle_sigterm=False, storage_options=opts) as mgr:
            for s in (0, 1):
                mgr.save(s, states[s])
        return name

    def spec(name):
        return {"kind": "manager", "path": url(name), "base": f"/nonexistent/{name}",
                "tag": 2, "scale": 1, "keep": 2, "async": False, "storage_options": opts}

    seen = set()
    n = 0
    for k, _reply, op in kill_points(server, spec, setup):
        n += 1
        where = f"killed before op {k}: {op}"
        with cairn.CheckpointManager(url(f"k{k}"), max_to_keep=2, async_save=False,
                                     handle_sigterm=False, storage_options=opts) as mgr:
            steps = mgr.steps()
            assert steps in ([0, 1], [0, 1, 2], [1, 2]), (where, steps)
            for s in steps:
                assert_same(mgr.restore(s), states[s], f"{where}: step {s}")
            left = store_leftovers(objstore, bucket, f"k{k}/")
            assert left == [], (where, left)
            seen.add(tuple(steps))
            mgr.save(3, states[3])
            assert mgr.steps()[-2:] == [steps[-1], 3], where
            assert_same(mgr.restore(), states[3], where)
    assert {(0, 1), (0, 1, 2), (1, 2)} <= seen, seen
    _record(f"{objstore.scheme} manager save + retention", n, 0)
