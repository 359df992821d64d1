"""C-Blosc2 called directly: the "blosc2" and "blosc2-lz4" codecs' chunks coded between cairn's own buffers.

python-blosc2's `compress2` does, per chunk and with the GIL held, all that surrounds the coding: it
builds the parameters from keywords, creates and frees a C-Blosc2 context, allocates a `bytes` of
the input's size for the output and returns a copy of its used part; only the coding itself runs
without the GIL. With a dozen coder threads those held spans take turns, and on the TPU host the
"blosc2" codec coded at about half its C speed.

This module calls the C-Blosc2 shared library that python-blosc2's wheel ships (``blosc2/lib``)
through ctypes, which releases the GIL for the whole of each call: one compression context per
thread and element size, one decompression context per thread, each kept for the thread's life and
freed with it, and every chunk coded straight into the caller's buffer (or decoded straight into
the array that is being filled). What is left under the GIL is the call itself, about a
microsecond.

It is used only where it is known to be right, and python-blosc2's own functions code everything
otherwise, with the same chunk bytes:

- the library and its header (``blosc2/include/blosc2.h``) are found beside python-blosc2;
- that header declares `blosc2_cparams` and `blosc2_dparams` field for field as `_CPARAMS` and
  `_DPARAMS` below (ctypes passes the structs by value: a layout that differed would pass garbage);
- probe blocks of every element size coded here are byte for byte the chunks `compress2` gives
  with the same settings, and decode back here and with `decompress2`;
- the environment does not say ``CAIRN_BLOSC2_DIRECT=0``.

A load only decodes, and finds the library without importing python-blosc2 (`decoder`): the package is
located, the library and header beside it checked as above, and probe blocks coded and decoded back by
the library itself. Importing python-blosc2 took 1.3 s on the TPU host, inside a restart's first load.

Pure: no file or network I/O of checkpoints, no JAX.
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

log = logging.getLogger("cairn")

#: C-Blosc2's room for a chunk's header over its raw bytes (BLOSC2_MAX_OVERHEAD): a chunk of n raw
#: bytes is at most n + this many bytes (what does not compress is stored as it is).
MAX_OVERHEAD = 32
_MAX_FILTERS = 6  # BLOSC2_MAX_FILTERS, checked against the header
_ALWAYS_SPLIT = 1  # BLOSC_ALWAYS_SPLIT
#: How many short chunk sizes a thread keeps a compression context for (`Direct._cctx`).
SMALL_CONTEXTS = 8


class Setting(NamedTuple):
    """How cairn codes one of its C-Blosc2 codecs' chunks: C-Blosc2's compressor code (`BLOSC_ZSTD`, ...),
    level and filter, every filtered byte stream compressed on its own (``ALWAYS_SPLIT``), one thread;
    `split_block`: the Blosc block C-Blosc2's tuner chooses for these settings, per byte of element
    size (a chunk shorter than that is one block), which `Direct._cctx` must know."""

    compcode: int
    clevel: int
    filter: int
    split_block: int


#: The settings of cairn's C-Blosc2 codecs, by codec name (docs/FORMAT.md §6.4): "blosc2", byte shuffle
#: (1) then zstd (5) at level 1; "blosc2-lz4", bit shuffle (2) then LZ4 (1) at level 5, which stores
#: 3-10% more and decodes 1.5x, codes 2-3x as fast on one core (docs/compression.md).
SETTINGS = {"blosc2": Setting(5, 1, 1, 32 << 10), "blosc2-lz4": Setting(1, 5, 2, 64 << 10)}

#: The two parameter structs as the header must declare them: (C type, field name), in order.
_CPARAMS = (("uint8_t", "compcode"), ("uint8_t", "compcode_meta"), ("uint8_t", "clevel"), ("int", "use_dict"),
            ("int32_t", "typesize"), ("int16_t", "nthreads"), ("int32_t", "blocksize"), ("int32_t", "splitmode"),
            ("void*", "schunk"), ("uint8_t", "filters[BLOSC2_MAX_FILTERS]"),
            ("uint8_t", "filters_meta[BLOSC2_MAX_FILTERS]"), ("blosc2_prefilter_fn", "prefilter"),
            ("blosc2_prefilter_params*", "preparams"), ("void*", "tuner_params"), ("int", "tuner_id"),
            ("bool", "instr_codec"), ("void*", "codec_params"), ("void*", "filter_params[BLOSC2_MAX_FILTERS]"))
_DPARAMS = (("int16_t", "nthreads"), ("void*", "schunk"), ("blosc2_postfilter_fn", "postfilter"),
            ("blosc2_postfilter_params*", "postparams"), ("int32_t", "typesize"))


class _CParams(ctypes.Structure):
    _fields_ = [("compcode", ctypes.c_uint8), ("compcode_meta", ctypes.c_uint8), ("clevel", ctypes.c_uint8),
                ("use_dict", ctypes.c_int), ("typesize", ctypes.c_int32), ("nthreads", ctypes.c_int16),
                ("blocksize", ctypes.c_int32), ("splitmode", ctypes.c_int32), ("schunk", ctypes.c_void_p),
                ("filters", ctypes.c_uint8 * _MAX_FILTERS), ("filters_meta", ctypes.c_uint8 * _MAX_FILTERS),
                ("prefilter", ctypes.c_void_p), ("preparams", ctypes.c_void_p), ("tuner_params", ctypes.c_void_p),
                ("tuner_id", ctypes.c_int), ("instr_codec", ctypes.c_bool), ("codec_params", ctypes.c_void_p),
                ("filter_params", ctypes.c_void_p * _MAX_FILTERS)]


class _DParams(ctypes.Structure):
    _fields_ = [("nthreads", ctypes.c_int16), ("schunk", ctypes.c_void_p), ("postfilter", ctypes.c_void_p),
                ("postparams", ctypes.c_void_p), ("typesize", ctypes.c_int32)]


def _declared(header: str, name: str) -> tuple[tuple[str, str], ...] | None:
    """The (type, field) pairs of the struct typedef `name` in the C `header` text, or None."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", header, flags=re.S)
    m = re.search(r"typedef\s+struct\s*(?:\w+\s*)?\{([^{}]*)\}\s*" + re.escape(name) + r"\s*;", text)
    if m is None:
        return None
    fields = []
    for decl in m.group(1).split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        decl = re.sub(r"\s*\[\s*", "[", re.sub(r"\s*\]", "]", decl))  # "x[ N ]" as "x[N]"
        decl = re.sub(r"\s*\*\s*", "* ", decl)  # "void *x", "void* x" and "void * x" alike
        typ, _, field = decl.rpartition(" ")
        fields.append((typ.strip(), field.replace(" ", "")))
    return tuple(fields)


class _Context:
    """A C-Blosc2 context, freed when this object is collected (with the thread-local that holds it)."""

    __slots__ = ("_free", "ptr")

    def __init__(self, ptr: int, free: Any) -> None:
        self.ptr, self._free = ptr, free

    def __del__(self) -> None:
        self._free(self.ptr)


class Direct:
    """C-Blosc2's context functions, with the per-thread contexts of cairn's C-Blosc2 codecs (`SETTINGS`)."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._local = threading.local()
        lib.blosc2_get_blosc2_cparams_defaults.restype = _CParams
        lib.blosc2_get_blosc2_cparams_defaults.argtypes = []
        lib.blosc2_get_blosc2_dparams_defaults.restype = _DParams
        lib.blosc2_get_blosc2_dparams_defaults.argtypes = []
        lib.blosc2_create_cctx.argtypes = [_CParams]
        lib.blosc2_create_cctx.restype = ctypes.c_void_p
        lib.blosc2_create_dctx.argtypes = [_DParams]
        lib.blosc2_create_dctx.restype = ctypes.c_void_p
        lib.blosc2_free_ctx.argtypes = [ctypes.c_void_p]
        lib.blosc2_free_ctx.restype = None
        for f in (lib.blosc2_compress_ctx, lib.blosc2_decompress_ctx):
            f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32]
            f.restype = ctypes.c_int
        self._compress = lib.blosc2_compress_ctx
        self._decompress = lib.blosc2_decompress_ctx

    def _cctx(self, codec: str, k: int, n: int) -> int:
        """This thread's compression context for n bytes of k-byte elements of `codec` (`SETTINGS`).

        A C-Blosc2 context is not stateless: it keeps the block size its tuner chose for the last chunk
        and takes it as the one asked for in the next, so a context that coded a short chunk codes
        longer ones in short blocks, unlike a fresh context (which `compress2` makes every call). The
        tuner's choice for cairn's settings is the setting's `split_block` times the element size, or the
        whole chunk where that is shorter: chunks of at least that size share one context (the size it
        keeps is the size each of them gets), and shorter ones are coded by a context kept for their
        exact size, up to `SMALL_CONTEXTS` sizes a thread. `_probe` checks both against `compress2`."""
        setting = SETTINGS[codec]
        big = n >= setting.split_block * k
        key = (codec, k, -1 if big else n)
        kept = getattr(self._local, "c", None)
        if kept is None:
            kept = self._local.c = {}
        ctx = kept.get(key)
        if ctx is None:
            if not big and sum(1 for key_ in kept if key_[2] >= 0) >= SMALL_CONTEXTS:
                del kept[next(key_ for key_ in kept if key_[2] >= 0)]  # the oldest short size's
            ctx = kept[key] = self.new_cctx(setting, k)
        return ctx.ptr

    def new_cctx(self, setting: Setting, k: int, blocksize: int = 0) -> _Context:
        """A new compression context for k-byte elements coded as `setting` says, as ``compress2(typesize=k,
        codec=..., clevel=..., filters=[...], splitmode=ALWAYS_SPLIT, nthreads=1)`` makes one; `blocksize`
        0: the tuner's Blosc block (else that many bytes)."""
        p = self._lib.blosc2_get_blosc2_cparams_defaults()
        p.compcode, p.compcode_meta, p.clevel, p.use_dict = setting.compcode, 0, setting.clevel, 0
        p.typesize, p.nthreads, p.blocksize, p.splitmode = k, 1, blocksize, _ALWAYS_SPLIT
        for i in range(_MAX_FILTERS):
            p.filters[i] = p.filters_meta[i] = 0
        p.filters[0] = setting.filter
        ptr = self._lib.blosc2_create_cctx(p)
        if not ptr:
            raise MemoryError("C-Blosc2 could not create a compression context")
        return _Context(ptr, self._lib.blosc2_free_ctx)

    def _dctx(self) -> int:
        ctx = getattr(self._local, "d", None)
        if ctx is None:
            p = self._lib.blosc2_get_blosc2_dparams_defaults()
            p.nthreads = 1
            ptr = self._lib.blosc2_create_dctx(p)
            if not ptr:
                raise MemoryError("C-Blosc2 could not create a decompression context")
            ctx = self._local.d = _Context(ptr, self._lib.blosc2_free_ctx)
        return ctx.ptr

    def compress_into(self, k: int, src: int, n: int, dst: int, room: int, codec: str = "blosc2") -> int:
        """Code the n raw bytes at address `src` (k-byte elements) as one chunk of `codec` (`SETTINGS`) at
        address `dst`, which has `room` bytes (at least n + MAX_OVERHEAD); its length. The caller keeps both
        buffers alive."""
        z = self._compress(self._cctx(codec, k, n), src, n, dst, room)
        if z <= 0:
            raise RuntimeError(f"C-Blosc2 failed to code {n} bytes into {room} (error {z})")
        return z

    def decompress_into(self, src: int, cbytes: int, dst: int, n: int) -> int:
        """Decode the chunk of `cbytes` bytes at address `src` into the n bytes at `dst` (C-Blosc2 writes
        no more than n); the count it wrote, negative where the chunk does not decode."""
        return self._decompress(self._dctx(), src, cbytes, dst, n)


def _library(b2_dir: Path) -> Path | None:
    for sub in ("lib", "lib64", "bin"):
        for name in ("libblosc2.so", "libblosc2.dylib", "blosc2.dll", "libblosc2.dll"):
            p = b2_dir / sub / name
            if p.is_file():
                return p
    return None


def address(buf: Any) -> tuple[int, Any]:
    """The address of a contiguous bytes-like `buf`, and the object that keeps it valid (hold it until the
    C call returns)."""
    if isinstance(buf, np.ndarray):
        return buf.__array_interface__["data"][0], buf
    if isinstance(buf, memoryview) and not buf.readonly:
        c = ctypes.c_char.from_buffer(buf)
        return ctypes.addressof(c), c
    a = np.frombuffer(buf, np.uint8)
    return a.__array_interface__["data"][0], a


def _probe_blocks() -> Iterator[tuple[str, Setting, int, np.ndarray]]:
    """(codec, its setting, element size, raw block): the probe blocks of `_probe` and `_headers`, each
    codec's and element size's in an order that shows a context's carried state: long, short, longer,
    other short, the first short again, an incompressible one and a few elements."""
    rng = np.random.default_rng(7)
    normal = (rng.standard_normal(160 << 10) * 0.02).astype(np.float32).view(np.uint8)
    noise = rng.integers(0, 256, 40 << 10, dtype=np.uint8)
    for (codec, s), k in itertools.product(SETTINGS.items(), (1, 2, 4, 8, 16)):
        for raw in (normal[: (24 << 10) // k * k], normal[: 1000 * k], normal[: (600 << 10) // k * k],
                    normal[: 37 * k], normal[: 1000 * k], noise[: (len(noise) // k) * k - k], normal[: k * 3]):
            yield codec, s, k, raw


def _probe(direct: Direct, b2: Any) -> str | None:
    """Why `direct` may not stand in for python-blosc2 (None: it may): probe blocks of each element size,
    trained-like and incompressible, coded both ways must be the same chunks and decode back both ways."""
    for codec, s, k, raw in _probe_blocks():
        ref = b2.compress2(raw, typesize=k, codec=b2.Codec(s.compcode), clevel=s.clevel,
                           filters=[b2.Filter(s.filter)], splitmode=b2.SplitMode.ALWAYS_SPLIT, nthreads=1)
        chunk = _code(direct, codec, k, raw)
        if chunk.tobytes() != ref:
            return f"its {codec!r} chunk of {raw.nbytes} bytes of {k}-byte elements differs from compress2's"
        back = _back(direct, chunk, raw.nbytes)
        if back is None:
            return "it does not decode its own chunk"
        if not np.array_equal(back, raw) or b2.decompress2(ref) != raw.tobytes():
            return "a chunk does not decode to its raw bytes"
    return None


def _code(direct: Direct, codec: str, k: int, raw: np.ndarray) -> np.ndarray:
    """`raw` (k-byte elements) coded by `direct` as one chunk of `codec`: each probe's first step."""
    out = np.empty(raw.nbytes + MAX_OVERHEAD, np.uint8)
    return out[: direct.compress_into(k, address(raw)[0], raw.nbytes, address(out)[0], out.nbytes, codec)]


def _back(direct: Direct, chunk: np.ndarray, n: int) -> np.ndarray | None:
    """`chunk` decoded by `direct` into n bytes, or None where it does not decode to exactly n."""
    back = np.empty(n, np.uint8)
    return back if direct.decompress_into(address(chunk)[0], chunk.nbytes, address(back)[0], n) == n else None


#: A chunk header's compressor code (bits 5-7 of byte 2) for each compressor code of `SETTINGS`: zstd, LZ4.
_HEADER_FORMAT = {5: 4, 1: 1}
_MEMCPYED = 0x02  # a chunk's flag (byte 2): its blocks are stored as they are


def _headers(direct: Direct) -> str | None:
    """Why `direct` may not code cairn's chunks (None: it may), found without python-blosc2: every probe
    block of `_probe` coded here decodes back here, and its chunk's header records what compress2 with the
    codec's setting records: the element size (byte 3), the raw size (bytes 4-7), the Blosc block its
    tuner picks (8-11: the setting's `split_block` times the element size, or the whole chunk where that is
    shorter; a context that carried a block size from an earlier chunk shows here), the setting's filter
    alone (16-21) and, where the chunk is compressed, its compressor (bits 5-7 of byte 2). What the
    header does not record, the level, is passed in the struct layout `_found` checked."""
    for codec, s, k, raw in _probe_blocks():
        chunk = _code(direct, codec, k, raw)
        h = chunk[:MAX_OVERHEAD].tobytes()
        what = f"its {codec!r} chunk of {raw.nbytes} bytes of {k}-byte elements"
        size, block = (int.from_bytes(h[i : i + 4], "little") for i in (4, 8))
        if len(h) < MAX_OVERHEAD or h[3] != k or size != raw.nbytes:
            return f"{what} has a header of another size or element size"
        if block != min(s.split_block * k, raw.nbytes):
            return f"{what} is cut into Blosc blocks of {block} bytes, not {min(s.split_block * k, raw.nbytes)}"
        if h[16:22] != bytes([s.filter, 0, 0, 0, 0, 0]):
            return f"{what} names the filters {list(h[16:22])}, not [{s.filter}]"
        if not h[2] & _MEMCPYED and h[2] >> 5 != _HEADER_FORMAT[s.compcode]:
            return f"{what} names compressor {h[2] >> 5}, not {_HEADER_FORMAT[s.compcode]}"
        back = _back(direct, chunk, raw.nbytes)
        if back is None or not np.array_equal(back, raw):
            return f"{what} does not decode back to its raw bytes"
    return None


def _roundtrip(direct: Direct) -> str | None:
    """Why `direct` may not decode cairn's chunks (None: it may), found without python-blosc2: probe blocks
    of each element size, trained-like and incompressible, coded and decoded back here by C-Blosc2 itself
    (`decoder`; the bytes coded are checked against python-blosc2's where a save codes, `_probe`)."""
    rng = np.random.default_rng(7)
    normal = (rng.standard_normal(40 << 10) * 0.02).astype(np.float32).view(np.uint8)
    noise = rng.integers(0, 256, 20 << 10, dtype=np.uint8)
    for codec, k in itertools.product(SETTINGS, (1, 2, 4, 8, 16)):
        for raw in (normal[: (100 << 10) // k * k], normal[: 37 * k], noise[: (len(noise) // k) * k - k]):
            back = _back(direct, _code(direct, codec, k, raw), raw.nbytes)
            if back is None:
                return f"it does not decode its own {codec!r} chunk of {raw.nbytes} bytes"
            if not np.array_equal(back, raw):
                return f"its {codec!r} chunk of {raw.nbytes} bytes does not decode to its raw bytes"
    return None


_lock = threading.Lock()
_loaded: list[Direct | None] = []
_decoding: list[Direct | None] = []
_encoding: list[Direct | None] = []


def decoder() -> Direct | None:
    """The direct path for decoding, found without importing python-blosc2 (which takes 1.3 s on the TPU
    host, a restart's first compressed load): its package located, the library and header beside it checked as `load` does, and blocks
    coded and decoded back by the library itself (`_roundtrip`). The direct path `load` found, where it
    ran first. None where it cannot be shown to decode (the caller then uses python-blosc2's functions)."""
    if not _loaded and not _decoding:
        _once(_decoding, lambda: _beside_package(_roundtrip), "decoded through python-blosc2's functions")
    return _loaded[0] if _loaded else _decoding[0]


def encoder() -> Direct | None:
    """The direct path for coding, found without importing python-blosc2 (1.3 s on the TPU host, in a
    process's first compressed save): its package located, the library and header beside it checked as
    `load` does, and probe blocks coded by the library itself, each chunk's header recording the codec's
    settings and each decoding back (`_headers`). The direct path `load` found, where it ran first. None
    where it cannot be shown to code as cairn's settings say (the caller then takes `load`'s, checked
    against python-blosc2's `compress2`)."""
    if not _loaded and not _encoding:
        _once(_encoding, lambda: _beside_package(_headers), "coded only after importing python-blosc2")
    return _loaded[0] if _loaded else _encoding[0]


def load(b2: Any) -> Direct | None:
    """The direct path for python-blosc2 module `b2`, or None where it cannot be shown to code the same
    chunks (found and checked once per process; the reason logged at debug level)."""
    if not _loaded:
        _once(_loaded, lambda: _found(Path(b2.__file__).parent, lambda d: _probe(d, b2)),
              "coded through python-blosc2's functions")
    return _loaded[0]


def _once(found: list[Direct | None], search: Callable[[], tuple[Direct | None, str | None]], done: str) -> None:
    """Put in `found` (`_loaded`, `_decoding` or `_encoding`), unless there already, the direct path `search`
    finds, or None where it finds none, fails or ``CAIRN_BLOSC2_DIRECT`` is off (the reason logged at debug
    level, after "C-Blosc2 chunks " and what is `done` instead)."""
    with _lock:
        if found:
            return
        direct, why = None, None
        if os.environ.get("CAIRN_BLOSC2_DIRECT", "1").strip().lower() in ("0", "false", "no", "off"):
            why = "CAIRN_BLOSC2_DIRECT is off"
        else:
            try:
                direct, why = search()
            except (OSError, AttributeError, RuntimeError, MemoryError, ValueError) as e:
                direct, why = None, f"{type(e).__name__}: {e}"
        if direct is None:
            log.debug("cairn: C-Blosc2 chunks %s (%s)", done, why)
        found.append(direct)


def _beside_package(probe: Callable[[Direct], str | None]) -> tuple[Direct | None, str | None]:
    """`_found` with `probe` in the folder of python-blosc2's package, located without importing it."""
    try:
        spec = importlib.util.find_spec("blosc2")
    except (ImportError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"
    if spec is None or not spec.origin:
        return None, "python-blosc2 is not installed"
    return _found(Path(spec.origin).parent, probe)


def _found(b2_dir: Path, probe: Callable[[Direct], str | None]) -> tuple[Direct | None, str | None]:
    """The direct path to the library in python-blosc2's package folder `b2_dir`, where its header declares
    the layouts cairn passes and `probe` finds no fault (else None, and why)."""
    lib_path = _library(b2_dir)
    header = b2_dir / "include" / "blosc2.h"
    if lib_path is None or not header.is_file():
        return None, f"no C-Blosc2 library and header beside python-blosc2 in {b2_dir}"
    text = header.read_text(errors="replace")
    m = re.search(r"#define\s+BLOSC2_MAX_FILTERS\s+(\d+)", text) or re.search(
        r"\bBLOSC2_MAX_FILTERS\s*=\s*(\d+)", text)
    if m is None or int(m.group(1)) != _MAX_FILTERS:
        return None, f"{header} does not declare BLOSC2_MAX_FILTERS = {_MAX_FILTERS}"
    for name, want in (("blosc2_cparams", _CPARAMS), ("blosc2_dparams", _DPARAMS)):
        if _declared(text, name) != want:
            return None, f"{header} declares {name} differently from the layout cairn passes"
    lib = ctypes.CDLL(str(lib_path))
    # Once per process, as python-blosc2's import does (a second call returns at once). Called holding the
    # GIL (`PyDLL`), as that import calls it, so the two never run at once: its guard is a plain flag.
    init = ctypes.PyDLL(str(lib_path)).blosc2_init
    init.argtypes, init.restype = [], None
    init()
    direct = Direct(lib)
    why = probe(direct)
    return (None, why) if why else (direct, None)
