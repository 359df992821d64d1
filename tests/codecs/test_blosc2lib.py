"""C-Blosc2 called directly (`cairn._codecs.blosc2lib`): the same chunks as python-blosc2's compress2,
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

from cairn._codecs import blosc2lib
from cairn._codecs import codecs as _codecs

pytestmark = pytest.mark.skipif(not _codecs.blosc2_available(), reason="python-blosc2 is not installed")


def _b2():
    return _codecs._blosc2()


#: cairn's C-Blosc2 codecs: each test about their chunks runs for each.
B2 = _codecs.BLOSC2_CODECS


def _ref(raw: np.ndarray, k: int, codec: str = "blosc2") -> bytes:
    return _b2().compress2(raw, **_codecs._blosc2_params(codec, k))


def _direct(raw: np.ndarray, k: int, d: blosc2lib.Direct | None = None, codec: str = "blosc2") -> bytes:
    d = d or blosc2lib.load(_b2())
    assert d is not None
    out = np.empty(raw.nbytes + blosc2lib.MAX_OVERHEAD, np.uint8)
    n = d.compress_into(k, blosc2lib.address(raw)[0], raw.nbytes, blosc2lib.address(out)[0], out.nbytes, codec)
    return out[:n].tobytes()


def test_the_settings_are_the_codecs_of_the_format():
    """Each C-Blosc2 codec has its settings, and they are what docs/FORMAT.md §6.4 names: "blosc2" the byte
    shuffle (1) and zstd (5) at level 1, "blosc2-lz4" the bit shuffle (2) and LZ4 (1) at level 5."""
    assert set(blosc2lib.SETTINGS) == set(B2) == {"blosc2", "blosc2-lz4"}
    got = {c: (s.compcode, s.clevel, s.filter) for c, s in blosc2lib.SETTINGS.items()}
    assert got == {"blosc2": (5, 1, 1), "blosc2-lz4": (1, 5, 2)}
    b2 = _b2()
    for codec, (compcode, clevel, filter_) in (("blosc2", (b2.Codec.ZSTD, 1, b2.Filter.SHUFFLE)),
                                               ("blosc2-lz4", (b2.Codec.LZ4, 5, b2.Filter.BITSHUFFLE))):
        kw = _codecs._blosc2_params(codec, 4)
        assert (kw["codec"], kw["clevel"], kw["filters"], kw["typesize"]) == (compcode, clevel, [filter_], 4)
        assert kw["splitmode"] == b2.SplitMode.ALWAYS_SPLIT and kw["nthreads"] == 1


def test_the_pinned_python_blosc2_is_called_directly():
    """With the python-blosc2 that `dev` installs (CI's), the header matches, the probe passes and the
    codec's saves and loads take the direct path (were it silently off, nothing else would fail)."""
    assert blosc2lib.load(_b2()) is not None


@pytest.mark.parametrize("codec", B2)
def test_a_context_carries_no_chunk_size_into_the_next(codec):
    """C-Blosc2 keeps the block size it chose for a chunk as the one asked for in the next: coding short
    chunks of many sizes (more than a thread keeps contexts for) between long ones, in one thread, must
    give compress2's bytes for every chunk, as a fresh context would, for each codec's settings (the
    sizes straddle both codecs' tuned Blosc blocks, 32 and 64 KiB per byte of element size)."""
    rng = np.random.default_rng(5)
    for dtype in (ml_dtypes.bfloat16, np.float32, np.uint8, np.float64, np.complex128):
        k = np.dtype(dtype).itemsize
        x = (rng.standard_normal((1 << 20) // k + 99) * 0.02).astype(np.float32).astype(dtype).view(np.uint8)
        split = blosc2lib.SETTINGS[codec].split_block * k
        sizes = [1 << 20, 17 * k, 3 << 20 >> 2, 4000 * k] + [k * int(n) for n in rng.integers(1, 40000, 12)]
        sizes += [1 << 20, 1, 5 * k, split - k, split, 1 << 20, split + k, x.nbytes, 17 * k]
        for n in sizes:
            n = min(n // k * k, x.nbytes)
            raw = x[:n]
            assert _direct(raw, k, codec=codec) == _ref(raw, k, codec), (dtype, n)


def test_the_codecs_contexts_are_their_own():
    """One thread coding both codecs' chunks in turn, of the same sizes and element sizes: each chunk is
    its own codec's compress2 bytes (a context kept for one codec is never taken for the other's), and
    names its codec's filter and compressor in its header (byte 16, and bits 5-7 of byte 2)."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal(300_000) * 0.02).astype(np.float32).view(np.uint8)
    header = {"blosc2": (1, 4), "blosc2-lz4": (2, 1)}  # (filter, the header's compressor code: zstd 4, LZ4 1)
    for n in (1 << 20, 4000, 777 * 4, 4000, 1 << 20, 96 << 10, 4):
        for codec in (*B2, *reversed(B2)):
            raw = x[:min(n, x.nbytes)]
            z = _direct(raw, 4, codec=codec)
            assert z == _ref(raw, 4, codec), (codec, n)
            filter_, compressor = header[codec]
            # (a chunk under 32 bytes, BLOSC_MIN_BUFFERSIZE, is stored as it is and names compressor 0)
            assert z[16] == filter_ and z[2] >> 5 == (compressor if raw.nbytes >= 32 else 0), (codec, n)


def test_threads_code_at_once_and_free_their_contexts():
    """Eight threads coding at once, each both codecs' chunks, each get compress2's chunks, and every
    context a thread made is freed when the thread ends (a save's coder pool comes and goes with each save)."""
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
        for i, raw in enumerate(raws[t % 4:] + raws[: t % 4]):
            codec = B2[(t + i) % len(B2)]  # each thread codes both codecs' chunks, in turns
            z = _direct(raw, 4, d, codec)
            back = np.empty(raw.nbytes, np.uint8)
            if d.decompress_into(blosc2lib.address(np.frombuffer(z, np.uint8))[0], len(z),
                                 blosc2lib.address(back)[0], back.nbytes) != raw.nbytes or z != _ref(raw, 4, codec):
                wrong.append((t, codec, raw.nbytes))
            elif not np.array_equal(back, raw):
                wrong.append((t, raw.nbytes, "decoded"))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert not wrong
    assert len(made) >= 8 * 3 and sorted(freed) == sorted(made)  # per thread: one per codec, and a decoder


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


def _found(fake):
    return blosc2lib._found(Path(fake.__file__).parent, lambda d: blosc2lib._probe(d, fake))


def test_falls_back_where_the_header_declares_another_layout(tmp_path, caplog):
    """A python-blosc2 whose header declares blosc2_cparams with one more field (a later C-Blosc2, say):
    cairn does not pass its structs to that library, and says why at debug level."""
    fake = _fake_blosc2(tmp_path, header=lambda t: t.replace("  int32_t splitmode;",
                                                             "  int32_t splitmode;\n  int32_t newer;", 1))
    why = _found(fake)
    assert why[0] is None and "blosc2_cparams" in why[1] and str(tmp_path) in why[1]
    intact = _fake_blosc2(tmp_path / "ok")
    direct, why = _found(intact)
    assert direct is not None and why is None  # the same folder with the header as shipped: taken


def test_falls_back_without_the_library_or_when_turned_off(tmp_path, monkeypatch):
    fake = _fake_blosc2(tmp_path, lib=False)
    direct, why = _found(fake)
    assert direct is None and "no C-Blosc2 library" in why
    monkeypatch.setattr(blosc2lib, "_loaded", [])
    monkeypatch.setattr(blosc2lib, "_encoding", [])
    monkeypatch.setenv("CAIRN_BLOSC2_DIRECT", "0")
    assert blosc2lib.load(_b2()) is None and blosc2lib.encoder() is None
    # and both codecs then code through python-blosc2, with the same bytes
    raw = np.arange(5000, dtype=np.float32).view(np.uint8)
    for codec in B2:
        assert [bytes(b) for b in _codecs.encode_run(codec, raw, 4096, np.float32)] == [
            _ref(raw[o:o + 4096], 4, codec) for o in range(0, raw.nbytes, 4096)]


@pytest.mark.parametrize("codec", B2)
@pytest.mark.parametrize("change", ["compressor", "filter"])
def test_falls_back_where_a_probe_chunk_differs(codec, change):
    """The probe codes blocks of each codec both ways before the direct path is trusted: a library that
    coded one codec's chunks differently (here: its contexts made with another compressor, zlib, or the
    other shuffle) is not used, and the probe names that codec."""
    real = blosc2lib.load(_b2())._lib
    assert blosc2lib._probe(blosc2lib.Direct(real), _b2()) is None
    setting = blosc2lib.SETTINGS[codec]

    class Tampered:  # the real library, but the contexts of `codec`'s settings made otherwise
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def blosc2_create_cctx(p):
            if (p.compcode, p.filters[0]) == (setting.compcode, setting.filter):
                if change == "compressor":
                    p.compcode = 4  # BLOSC_ZLIB, where compress2 is told zstd or LZ4
                else:
                    p.filters[0] = 3 - setting.filter  # the byte shuffle for the bit shuffle, or back
            return real.blosc2_create_cctx(p)

    why = blosc2lib._probe(blosc2lib.Direct(Tampered()), _b2())
    assert why is not None and f"its {codec!r} chunk" in why and "differs from compress2" in why
    # and without python-blosc2: the chunks' headers name another compressor or filter
    why = blosc2lib._headers(blosc2lib.Direct(Tampered()))
    assert why is not None and f"its {codec!r} chunk" in why
    assert ("names compressor" if change == "compressor" else "names the filters") in why, why


def test_the_header_probe_passes_the_library_and_sees_a_carried_block_size():
    """`_headers`, the check of a save that has not imported python-blosc2: the library as shipped passes
    it (and its chunks are compress2's, `_probe`); a Direct whose contexts were kept for every chunk size
    alike (carrying the Blosc block chosen for a short chunk into a long one) fails it, naming the block."""
    real = blosc2lib.load(_b2())._lib
    assert blosc2lib._headers(blosc2lib.Direct(real)) is None
    assert blosc2lib._probe(blosc2lib.Direct(real), _b2()) is None

    class OneContext(blosc2lib.Direct):
        def _cctx(self, codec, k, n):
            return super()._cctx(codec, k, 1 << 40)  # every size takes the context kept for long chunks

    why = blosc2lib._headers(OneContext(real))
    assert why is not None and "is cut into Blosc blocks of" in why, why


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


def test_a_load_decodes_without_importing_python_blosc2(tmp_path):
    """A fresh process's compressed load finds C-Blosc2 beside python-blosc2 and decodes with it, without
    importing python-blosc2 (1.3 s on the TPU host, in a restart's first load): the values are the same.
    Nor does a save, in a fresh process or after the load: it codes with the library checked by its
    chunks' headers (`blosc2lib.encoder`), and its chunks are compress2's."""
    import subprocess
    import sys

    code = """
import sys, numpy as np, cairn
w = (np.random.default_rng(1).standard_normal((300, 70)) * 0.02).astype(np.float32)
x = np.arange(999, dtype=np.int16)
if sys.argv[1] == "save":
    from cairn._codecs import blosc2lib
    for c in ("blosc2", "blosc2-lz4"):
        cairn.save(sys.argv[2] + "/" + c, {"w": w, "x": x}, compression=c)
    print("imported" if "blosc2" in sys.modules else "not imported", blosc2lib._encoding[0] is not None)
else:
    from cairn._codecs import blosc2lib
    for c in ("blosc2", "blosc2-lz4"):
        got = cairn.load(sys.argv[2] + "/" + c)
        assert (got["w"] == w).all() and (got["x"] == x).all(), c
    print("imported" if "blosc2" in sys.modules else "not imported", blosc2lib._decoding[0] is not None)
    cairn.save(sys.argv[2] + "/again", {"w": w}, compression="blosc2-lz4")
    print("imported" if "blosc2" in sys.modules else "not imported", blosc2lib._encoding[0] is not None)
    assert (cairn.load(sys.argv[2] + "/again")["w"] == w).all()
"""
    saved = subprocess.run([sys.executable, "-c", code, "save", str(tmp_path)], check=True, capture_output=True,
                           text=True).stdout.split("\n")
    assert saved[0] == "not imported True"
    out = subprocess.run([sys.executable, "-c", code, "load", str(tmp_path)], check=True, capture_output=True,
                         text=True).stdout.split("\n")
    assert out[:2] == ["not imported True", "not imported True"]
    # the chunks coded without python-blosc2 are the ones its compress2 gives
    from cairn._load.source import open_checkpoint

    ck = open_checkpoint(tmp_path / "again")
    leaf = ck.indexes["w"].leaves[0]
    assert leaf.codec == "blosc2-lz4"
    data = next(p for p in (tmp_path / "again" / "w").iterdir() if p.suffix == ".bin").read_bytes()
    raw = (np.random.default_rng(1).standard_normal((300, 70)) * 0.02).astype(np.float32).view(np.uint8).reshape(-1)
    assert _ref(raw, 4, "blosc2-lz4") == data  # one chunk of one block (84,000 bytes): the whole file


def test_the_decoder_falls_back_where_turned_off_or_where_its_roundtrip_fails(monkeypatch):
    real = blosc2lib.Direct(blosc2lib.load(_b2())._lib)
    monkeypatch.setattr(blosc2lib, "_loaded", [])
    monkeypatch.setattr(blosc2lib, "_decoding", [])
    monkeypatch.setenv("CAIRN_BLOSC2_DIRECT", "0")
    assert blosc2lib.decoder() is None
    raw = (np.random.default_rng(2).standard_normal(3000) * 0.02).astype(np.float32)
    for codec in B2:  # python-blosc2's functions decode then
        stored = _codecs.encode(codec, raw, np.float32)
        assert bytes(_codecs.decode(codec, stored, np.float32, raw.nbytes)) == raw.tobytes()

    assert blosc2lib._roundtrip(real) is None

    class Shortchanged(blosc2lib.Direct):  # a library that decodes a byte short
        def decompress_into(self, src, cbytes, dst, n):
            return real.decompress_into(src, cbytes, dst, n) - 1

    why = blosc2lib._roundtrip(Shortchanged(real._lib))
    assert why is not None and "does not decode its own 'blosc2' chunk" in why
