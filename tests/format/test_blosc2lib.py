"""C-Blosc2 called directly (`cairn._format.blosc2lib`): the same chunks as python-blosc2's compress2,
per-thread contexts that carry no state from one chunk to the next, and a fallback wherever the
library, its header or its behaviour is not the one checked."""

from __future__ import annotations

import gc
import shutil
import threading
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cairn._format import blosc2lib
from cairn._format import codecs as _codecs

pytestmark = pytest.mark.skipif(not _codecs.blosc2_available(), reason="python-blosc2 is not installed")


def _b2():
    return _codecs._blosc2()


def _ref(raw: np.ndarray, k: int) -> bytes:
    return _b2().compress2(raw, **_codecs._blosc2_params(k))


def _direct(raw: np.ndarray, k: int, d: blosc2lib.Direct | None = None) -> bytes:
    d = d or blosc2lib.load(_b2())
    assert d is not None
    out = np.empty(raw.nbytes + blosc2lib.MAX_OVERHEAD, np.uint8)
    n = d.compress_into(k, blosc2lib.address(raw)[0], raw.nbytes, blosc2lib.address(out)[0], out.nbytes)
    return out[:n].tobytes()


def test_the_pinned_python_blosc2_is_called_directly():
    """With the python-blosc2 that `dev` installs (CI's), the header matches, the probe passes and the
    codec's saves and loads take the direct path (were it silently off, nothing else would fail)."""
    assert blosc2lib.load(_b2()) is not None


def test_a_context_carries_no_chunk_size_into_the_next():
    """C-Blosc2 keeps the block size it chose for a chunk as the one asked for in the next: coding short
    chunks of many sizes (more than a thread keeps contexts for) between long ones, in one thread, must
    give compress2's bytes for every chunk, as a fresh context would."""
    rng = np.random.default_rng(5)
    for dtype in (ml_dtypes.bfloat16, np.float32, np.uint8, np.complex128):
        k = np.dtype(dtype).itemsize
        x = (rng.standard_normal((1 << 20) // k + 99) * 0.02).astype(np.float32).astype(dtype).view(np.uint8)
        sizes = [1 << 20, 17 * k, 3 << 20 >> 2, 4000 * k] + [k * int(n) for n in rng.integers(1, 40000, 12)]
        sizes += [1 << 20, 1, 5 * k, 1 << 20, x.nbytes, 17 * k]
        for n in sizes:
            n = min(n // k * k, x.nbytes)
            raw = x[:n]
            assert _direct(raw, k) == _ref(raw, k), (dtype, n)


def test_threads_code_at_once_and_free_their_contexts():
    """Eight threads coding at once each get compress2's chunks, and every context a thread made is
    freed when the thread ends (a save's coder pool comes and goes with each save)."""
    real = blosc2lib.load(_b2())._lib
    made, freed = [], []

    class Counting:  # the real library, its context functions counted
        def __getattr__(self, name):
            return getattr(real, name)

    lib = Counting()

    def counted(fn, into):
        def call(*args):
            r = fn(*args)
            into.append(r if fn is not real.blosc2_free_ctx else args[0])
            return r
        return call

    lib.blosc2_create_cctx = counted(real.blosc2_create_cctx, made)
    lib.blosc2_create_dctx = counted(real.blosc2_create_dctx, made)
    lib.blosc2_free_ctx = counted(real.blosc2_free_ctx, freed)

    d = blosc2lib.Direct(lib)
    rng = np.random.default_rng(9)
    raws = [(rng.standard_normal(n) * 0.02).astype(np.float32).view(np.uint8) for n in (300_000, 5000, 262_144, 77)]
    wrong = []

    def work(t):
        for raw in raws[t % 4:] + raws[: t % 4]:
            z = _direct(raw, 4, d)
            back = np.empty(raw.nbytes, np.uint8)
            if d.decompress_into(blosc2lib.address(np.frombuffer(z, np.uint8))[0], len(z),
                                 blosc2lib.address(back)[0], back.nbytes) != raw.nbytes or z != _ref(raw, 4):
                wrong.append((t, raw.nbytes))
            elif not np.array_equal(back, raw):
                wrong.append((t, raw.nbytes, "decoded"))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert not wrong
    assert len(made) >= 8 * 2 and sorted(freed) == sorted(made)


def _fake_blosc2(tmp_path: Path, header: str | None = None, lib: bool = True) -> types.SimpleNamespace:
    """A module standing in for python-blosc2: the real one's functions, a folder of our making."""
    real = _b2()
    src = Path(real.__file__).parent
    top = tmp_path / "blosc2"
    (top / "include").mkdir(parents=True)
    if lib:
        shutil.copytree(src / "lib", top / "lib", symlinks=True, ignore=shutil.ignore_patterns("*.a", "cmake",
                                                                                                "pkgconfig", "*tcc*"))
    text = (src / "include" / "blosc2.h").read_text()
    (top / "include" / "blosc2.h").write_text(text if header is None else header(text))
    fake = types.SimpleNamespace(**{n: getattr(real, n) for n in ("compress2", "decompress2", "Codec", "Filter",
                                                                   "SplitMode")})
    fake.__file__ = str(top / "__init__.py")
    return fake


def test_falls_back_where_the_header_declares_another_layout(tmp_path, caplog):
    """A python-blosc2 whose header declares blosc2_cparams with one more field (a later C-Blosc2, say):
    cairn does not pass its structs to that library, and says why at debug level."""
    fake = _fake_blosc2(tmp_path, header=lambda t: t.replace("  int32_t splitmode;",
                                                             "  int32_t splitmode;\n  int32_t newer;", 1))
    why = blosc2lib._found(fake)
    assert why[0] is None and "blosc2_cparams" in why[1] and str(tmp_path) in why[1]
    intact = _fake_blosc2(tmp_path / "ok")
    direct, why = blosc2lib._found(intact)
    assert direct is not None and why is None  # the same folder with the header as shipped: taken


def test_falls_back_without_the_library_or_when_turned_off(tmp_path, monkeypatch):
    fake = _fake_blosc2(tmp_path, lib=False)
    direct, why = blosc2lib._found(fake)
    assert direct is None and "no C-Blosc2 library" in why
    monkeypatch.setattr(blosc2lib, "_loaded", [])
    monkeypatch.setenv("CAIRN_BLOSC2_DIRECT", "0")
    assert blosc2lib.load(_b2()) is None
    # and the codec then codes through python-blosc2, with the same bytes
    raw = np.arange(5000, dtype=np.float32).view(np.uint8)
    assert [bytes(b) for b in _codecs.encode_run("blosc2", raw, 4096, np.float32)] == [
        _ref(raw[o:o + 4096], 4) for o in range(0, raw.nbytes, 4096)]


def test_falls_back_where_a_probe_chunk_differs(monkeypatch):
    """The probe codes blocks both ways before the direct path is trusted: a library that coded
    differently (here: told a different level) is not used."""
    d = blosc2lib.Direct(blosc2lib.load(_b2())._lib)
    assert blosc2lib._probe(d, _b2()) is None
    monkeypatch.setattr(blosc2lib, "_ZSTD", 4)  # zlib (BLOSC_ZLIB) where compress2 is told zstd
    other = blosc2lib.Direct(d._lib)
    assert "differs from compress2" in blosc2lib._probe(other, _b2())


def test_declared_reads_struct_fields_whatever_the_spacing():
    text = """
    /* a comment { with braces } */
    typedef struct {
      uint8_t   a;   //!< the a
      void *b;
      void*c[ N ];
      struct_fn  d ;
    } thing;
    """
    assert blosc2lib._declared(text, "thing") == (("uint8_t", "a"), ("void*", "b"), ("void*", "c[N]"),
                                                  ("struct_fn", "d"))
    assert blosc2lib._declared(text, "other") is None
