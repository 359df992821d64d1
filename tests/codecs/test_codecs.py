"""The per-block codecs (cairn._codecs.codecs): round trips, `choose`, and hostile stored blocks."""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn._codecs import blosc2lib
from cairn._codecs import choose as _choose
from cairn._codecs import codecs as _codecs
from cairn._errors import CorruptCheckpointError

FLOAT8 = [getattr(ml_dtypes, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                          "float8_e4m3b11fnuz", "float8_e4m3", "float8_e3m4", "float8_e8m0fnu")
          if hasattr(ml_dtypes, n)]
DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
          np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.complex64, np.complex128, *FLOAT8]
#: "blosc2" and "blosc2-lz4" (C-Blosc2 chunks, `BLOSC2_CODECS`) need python-blosc2, an optional extra
#: (pyproject's `fast`; `dev` has it, so CI tests it).
HAVE_BLOSC2 = _codecs.blosc2_available()
NEEDS_BLOSC2 = pytest.mark.skipif(not HAVE_BLOSC2, reason="python-blosc2 is not installed (pip install cairn-ckpt[fast])")
B2 = _codecs.BLOSC2_CODECS
#: Every codec, the C-Blosc2 ones skipped where python-blosc2 is absent; `AVAILABLE`: the codecs usable here.
CODECS = [pytest.param(c, marks=NEEDS_BLOSC2) if c in B2 else c for c in _codecs.CODECS]
AVAILABLE = tuple(c for c in _codecs.CODECS if c not in B2 or HAVE_BLOSC2)
CODED = ("zstd", "planes", *(pytest.param(c, marks=NEEDS_BLOSC2) for c in B2))
#: How each C-Blosc2 codec's chunks name themselves in their header: (Blosc filter at byte 16, the
#: compressor code in bits 5-7 of byte 2: zstd 4, LZ4 1; docs/FORMAT.md §6.4).
B2_HEADER = {"blosc2": (1, 4), "blosc2-lz4": (2, 1)}


def _values(dtype, n: int, seed: int = 0) -> np.ndarray:
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    if dt == np.bool_:
        return rng.random(n) < 0.1
    if dt.kind in "iu":
        return rng.integers(0, 100, n).astype(dt)
    if dt.kind == "c":
        return (rng.normal(0, 0.02, n) + 1j * rng.normal(0, 0.02, n)).astype(dt)
    return rng.normal(0, 0.02, n).astype(np.float32).astype(dt)


def _roundtrip(codec: str, raw: np.ndarray, dtype) -> None:
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    stored = _codecs.encode(codec, raw, dtype)
    assert isinstance(stored, bytes)
    got = _codecs.decode(codec, stored, dtype, raw.nbytes)
    assert bytes(got) == raw.tobytes()
    out = bytearray(raw.nbytes)
    assert _codecs.decode(codec, stored, dtype, raw.nbytes, out=out) is out
    assert bytes(out) == raw.tobytes()
    arr = np.empty(raw.nbytes, np.uint8)
    _codecs.decode(codec, memoryview(stored), dtype, raw.nbytes, out=arr)
    assert arr.tobytes() == raw.tobytes()


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [0, 1, 7, 1000, 65537])
def test_roundtrip(codec, dtype, n):
    _roundtrip(codec, _values(dtype, n), dtype)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32, np.float64, np.int32])
def test_roundtrip_special(codec, dtype):
    # a full 1 MiB block of random bytes, of zeros, and of the special float values
    dt = np.dtype(dtype)
    n = (1 << 20) // dt.itemsize
    _roundtrip(codec, np.random.default_rng(1).integers(0, 256, n * dt.itemsize, dtype=np.uint8), dtype)
    _roundtrip(codec, np.zeros(n, dt), dtype)
    if dt.kind == "f":
        _roundtrip(codec, np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40] * 100, np.float64).astype(dt), dtype)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(DTYPES), st.sampled_from(AVAILABLE), st.binary(max_size=4096),
       st.integers(0, 3))
def test_roundtrip_property(dtype, codec, data, repeat):
    dt = np.dtype(dtype)
    data = data * (1 + repeat * 50)  # some compressible, some not
    raw = np.frombuffer(data[: len(data) - len(data) % dt.itemsize], np.uint8)
    if dt == np.bool_:
        raw = (raw & 1).astype(np.uint8)
    _roundtrip(codec, raw, dtype)


def test_planes_stores_random_planes_raw_and_codes_exponents():
    x = np.random.default_rng(0).normal(0, 0.02, 1 << 18).astype(ml_dtypes.bfloat16)
    stored = _codecs.encode("planes", x.view(np.uint8), x.dtype)
    k, mask = struct.unpack_from("<BH", stored)
    assert (k, mask) == (2, 0b10)  # the high (exponent) byte coded, the low byte raw
    (length,) = struct.unpack_from("<I", stored, 3)
    n = x.size
    assert stored[7:7 + n] == x.view(np.uint8)[0::2].tobytes()  # plane 0 first, raw
    assert len(stored) == 7 + n + length
    assert len(stored) < 0.75 * x.nbytes


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError, match="whole number"):
        _codecs.encode("planes", b"\0" * 5, np.float32)
    with pytest.raises(ValueError, match="unknown codec"):
        _codecs.encode("lz4", b"\0" * 4, np.float32)
    with pytest.raises(ValueError, match="no codec"):
        _codecs.encode("zstd", b"", np.dtype(object))


# ------------------------------------------------------------------------------------ choose


def test_choose_none_on_random_bytes():
    rnd = np.random.default_rng(0).integers(0, 256, 256 << 10, dtype=np.uint8)
    for dt in (np.uint8, np.float32, ml_dtypes.bfloat16, np.int64, np.float64):
        assert _choose.choose(dt, rnd.view(dt)) == "none"
    assert _choose.choose(np.float32, np.zeros(0, np.float32)) == "none"


def test_choose_compresses_trained_like_data():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks/
    from benchmarks.trained_state import flatten, leaf_kind, make_state

    state = flatten(make_state(8 << 20, "bf16-f32", steps=3))
    for kind in ("params", "mu", "nu"):
        leaf = max((a for k, a in state.items() if leaf_kind(k) == kind), key=lambda a: a.nbytes)
        assert _choose.choose(leaf.dtype, _choose.sample(leaf)) == ("blosc2" if HAVE_BLOSC2 else "planes"), kind
    assert _choose.choose(np.float32, np.zeros(1 << 16, np.float32)) != "none"  # fresh Adam moments
    mask = np.random.default_rng(0).random(1 << 16) < 0.05
    assert _choose.choose(np.bool_, mask) != "none"
    ids = np.random.default_rng(0).integers(0, 32000, 1 << 15).astype(np.int32)
    assert _choose.choose(np.int32, ids) != "none"


def test_sample_is_bounded_and_spread():
    a = np.arange(1 << 20, dtype=np.float32)
    s = _choose.sample(a, nbytes=64 << 10, pieces=4)
    assert s.nbytes <= 64 << 10 and s[0] == 0 and s[-1] == a[-1]
    small = np.arange(10, dtype=np.float32)
    assert np.array_equal(_choose.sample(small), small)


# ------------------------------------------------------------------------------- corruption


def _stored(codec: str, dtype=np.float32, n: int = 4096) -> tuple[bytes, int]:
    raw = _values(dtype, n).view(np.uint8)
    return _codecs.encode(codec, raw, dtype), raw.nbytes


def _decodes_or_raises(codec: str, stored: bytes, dtype, raw_size: int) -> None:
    """A damaged block raises CorruptCheckpointError, or (where undetectable without the CRC) decodes to
    raw_size bytes; never another exception, never another size."""
    try:
        got = _codecs.decode(codec, stored, dtype, raw_size, where="ckpt/params.w")
    except CorruptCheckpointError as e:
        assert "ckpt/params.w" in str(e)
        return
    assert len(bytes(got)) == raw_size


@pytest.mark.parametrize("codec", CODED)
def test_truncated_and_extended(codec):
    stored, size = _stored(codec)
    for cut in range(len(stored)):
        if cut in (0, 1, 2, len(stored) - 1) or cut % 37 == 0:
            with pytest.raises(CorruptCheckpointError, match="ckpt/x"):
                _codecs.decode(codec, stored[:cut], np.float32, size, where="ckpt/x")
    for extra in (b"\0", b"\x28\xb5\x2f\xfd", stored):
        with pytest.raises(CorruptCheckpointError):
            _codecs.decode(codec, stored + extra, np.float32, size)
    with pytest.raises(CorruptCheckpointError):
        _codecs.decode("none", b"\0" * 7, np.float32, 8)


@pytest.mark.parametrize("codec", CODED)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int64])
def test_every_bit_flip(codec, dtype):
    stored, size = _stored(codec, dtype, 2048)
    for i in range(len(stored)):
        for bit in (0, 3, 7):
            bad = bytearray(stored)
            bad[i] ^= 1 << bit
            _decodes_or_raises(codec, bytes(bad), dtype, size)


@pytest.mark.parametrize("codec", CODED)
def test_wrong_sizes_and_dtypes(codec):
    stored, size = _stored(codec)
    for wrong in (0, size - 4, size + 4, size * 2, 1 << 40):
        with pytest.raises(CorruptCheckpointError, match="ckpt"):
            _codecs.decode(codec, stored, np.float32, wrong, where="ckpt")
    with pytest.raises(CorruptCheckpointError):
        _codecs.decode(codec, stored, np.float32, size - 1)  # not whole elements
    if codec == "planes":
        with pytest.raises(CorruptCheckpointError, match="planes"):
            _codecs.decode(codec, stored, np.float64, size)
    with pytest.raises(CorruptCheckpointError, match="unknown codec"):
        _codecs.decode("brotli", stored, np.float32, size)


def _zstd_frame_claiming(n: int) -> bytes:
    # a valid-looking frame header declaring n content bytes (8-byte size field), one tiny RLE block
    fhd = 0b11000000  # content size 8 bytes, not single segment, no checksum
    window = bytes([(27 - 10) << 3])  # 128 MiB window
    return b"\x28\xb5\x2f\xfd" + bytes([fhd]) + window + n.to_bytes(8, "little") + (1 | 1 << 1 | 16 << 3).to_bytes(3, "little") + b"\0"


def test_hostile_headers_never_allocate_what_they_claim():
    # A zstd frame that claims 2^40 bytes: rejected from the header against the index's size.
    with pytest.raises(CorruptCheckpointError, match="declares"):
        _codecs.decode("zstd", _zstd_frame_claiming(1 << 40), np.uint8, 16)
    # Claims the right size, but a window (128 MiB) far larger than the block: refused by the window cap.
    with pytest.raises(CorruptCheckpointError):
        _codecs.decode("zstd", _zstd_frame_claiming(1 << 12), np.uint8, 1 << 12)
    # A frame that decompresses to fewer bytes than it and the index say.
    frame = _zstd_frame_claiming(32)
    frame = frame[:-4] + (1 | 1 << 1 | 16 << 3).to_bytes(3, "little") + b"\0"
    with pytest.raises(CorruptCheckpointError):
        _codecs.decode("zstd", frame, np.uint8, 32)
    # planes headers: lengths beyond the block, a mask beyond the planes, huge lengths.
    stored, size = _stored("planes")
    for header in (struct.pack("<BH", 4, 0xFFFF), struct.pack("<BHI", 4, 0b1000, 0xFFFFFFFF),
                   struct.pack("<BHIIII", 4, 0b1111, 1, 1, 1, 1), struct.pack("<BH", 0, 0),
                   struct.pack("<BH", 255, 0)):
        with pytest.raises(CorruptCheckpointError):
            _codecs.decode("planes", header + stored[7:], np.float32, size)
    with pytest.raises(CorruptCheckpointError):
        _codecs.decode("planes", b"", np.float32, 0)
    assert bytes(_codecs.decode("planes", struct.pack("<BH", 4, 0), np.float32, 0)) == b""


def test_out_must_fit():
    stored, size = _stored("planes")
    with pytest.raises(ValueError, match="out has"):
        _codecs.decode("planes", stored, np.float32, size, out=bytearray(size + 1))


def test_threads_share_no_compressor():
    # zstandard's compressors are not thread-safe (a shared one crashes the process): each thread its own.
    from concurrent.futures import ThreadPoolExecutor

    blocks = [_values(np.float32, 1 << 16, seed).view(np.uint8) for seed in range(16)]
    with ThreadPoolExecutor(4) as ex:
        stored = list(ex.map(lambda b: _codecs.encode("planes", b, np.float32), blocks * 4))
        back = list(ex.map(lambda s: bytes(_codecs.decode("planes", s, np.float32, 1 << 18)), stored))
    assert back == [b.tobytes() for b in blocks * 4]


def _direct_entropy(plane: np.ndarray) -> float:
    """The order-0 entropy (bits a byte) of the probe's evenly strided sample of `plane`, computed directly."""
    n = plane.nbytes
    probe = plane[:: -(-n // _codecs.PLANE_PROBE)] if n > _codecs.PLANE_PROBE else plane
    p = np.bincount(probe, minlength=256) / probe.size
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def test_plane_probe_entropy_matches_the_formula():
    """The probe's entropy (one table lookup over the byte counts) decides as the order-0 entropy of the
    same evenly strided sample computed directly would, on both sides of the threshold."""
    rng = np.random.default_rng(3)
    seen = set()
    for n in (1, 100, 4096, 4097, 5000, 1 << 19):
        for spread in (1, 16, 100, 180, 200, 256):
            plane = rng.integers(0, spread, n).astype(np.uint8)
            h = _direct_entropy(plane)
            if abs(h - _codecs.PLANE_MAX_BITS) < 1e-9:
                continue
            assert _codecs._planes_worth_coding(plane, 1, n)[0, 0] == (h < _codecs.PLANE_MAX_BITS), (n, spread, h)
            seen.add(h < _codecs.PLANE_MAX_BITS)
    assert seen == {True, False}


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_encode_run_is_encode_of_each_block(codec, dtype):
    """A save codes a chunk's blocks in runs (`encode_run`): the bytes must be exactly what `encode`
    gives each block, whatever the dtype, run length, short last block or mix of coded planes."""
    k = np.dtype(dtype).itemsize
    big = _codecs.PLANE_PROBE_MIN_BYTES  # blocks from this size on are probed, smaller ones not
    for n, blocks in ((3 * 4096 + 5, (k, 64 * k, 4096 * k, None, 1 << 20)),
                      (3 * big // k + 5, (big, 2 * big, None))):  # short last blocks under and over `big`
        x = _values(dtype, n, seed=3)
        if np.dtype(dtype).kind == "f" and k >= 2:  # a random stretch: some blocks' planes stored raw
            x[: n // 6] = np.random.default_rng(4).integers(0, 256, n // 6 * k, np.uint8).view(dtype)
        raw = x.view(np.uint8)
        for block in blocks:
            block = block or raw.nbytes
            want = [_codecs.encode(codec, raw[o:o + block], dtype) for o in range(0, raw.nbytes, block)]
            assert _codecs.encode_run(codec, raw, block, dtype) == want
    assert _codecs.encode_run(codec, raw[:0], 64 * k, dtype) == []
    if k > 1:
        with pytest.raises(ValueError, match="not whole"):
            _codecs.encode_run(codec, raw, 64 * k + 1, dtype)


def test_the_run_probe_is_each_block_and_planes_probe():
    """`encode_run` probes every block and plane at once from the raw bytes; the answers must be
    each plane of each block's own, including blocks shorter than the probe and a short last block."""
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.normal(0, 0.02, 20000), rng.normal(0, 1e3, 7000)]).astype(np.float32)
    raw = x.view(np.uint8)
    for n in (100, 4096, 5000, 9999, 30000):
        got = _codecs._planes_worth_coding(raw, 4, n)
        planes = _codecs._split(raw, 4)
        want = [[_direct_entropy(planes[p, s:s + n]) < _codecs.PLANE_MAX_BITS for p in range(4)]
                for s in range(0, x.size, n)]
        assert got.tolist() == want
        if n >= 4096:  # (a probe of fewer bytes cannot see 7.5 bits of entropy: every plane looks codable)
            assert got.any() and not got.all()


def test_blocks_under_the_probe_size_try_every_plane():
    """A block under PLANE_PROBE_MIN_BYTES is not probed: zstd tries every plane. A plane of a repeated
    random pattern looks random to the probe (about 8 bits a byte) but zstd stores it in a fraction:
    coded in a small block, raw in a probed one, and `encode_run`'s short last block is coded as
    `encode` codes it on its own."""
    big = _codecs.PLANE_PROBE_MIN_BYTES
    pattern = np.random.default_rng(6).integers(0, 256, 4099, np.uint8)  # prime: the probe sees 4096 of it

    def block(nbytes: int) -> np.ndarray:  # uint16 elements: plane 0 repeats `pattern`, plane 1 is zero
        x = np.zeros(nbytes // 2, np.uint16)
        x[:] = np.resize(pattern, x.size)
        return x.view(np.uint8)

    def coded(stored: bytes) -> int:
        return struct.unpack_from("<BH", stored)[1]  # the mask of coded planes

    small, probed = block(big - 2048), block(big)
    assert coded(_codecs.encode("planes", small, np.uint16)) & 1
    assert not coded(_codecs.encode("planes", probed, np.uint16)) & 1
    run = np.concatenate([probed, small])  # a probed block, then a short one
    got = _codecs.encode_run("planes", run, big, np.uint16)
    assert got == [_codecs.encode("planes", probed, np.uint16), _codecs.encode("planes", small, np.uint16)]
    assert coded(got[1]) & 1


def test_a_batch_of_runs_is_encode_of_each_block():
    """A save codes many small chunks (leaves of several dtypes and codecs) in one `encode_runs` call:
    each run's blocks must be exactly what `encode` gives them, whatever the mix in the batch."""
    runs = []
    for i, dtype in enumerate(DTYPES):
        k = np.dtype(dtype).itemsize
        x = _values(dtype, 1000 + 37 * i, seed=i)
        codec = AVAILABLE[i % len(AVAILABLE)]
        runs.append((codec, x.view(np.uint8), 256 * k, dtype))
        runs.append(("planes", x.view(np.uint8)[: 5 * k], 4 * k, dtype))  # a tiny run, a short last block
    runs.append(("planes", np.zeros(0, np.uint8), 64, np.float32))  # an empty chunk
    got = _codecs.encode_runs(runs)
    assert len(got) == len(runs)
    for (codec, raw, block, dtype), blocks in zip(runs, got):
        assert blocks == [_codecs.encode(codec, raw[o:o + block], dtype) for o in range(0, raw.nbytes, block)]
    with pytest.raises(ValueError, match="unknown codec"):
        _codecs.encode_runs([("lz4", np.zeros(8, np.uint8), 8, np.uint8)])


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32, np.float64, np.uint8, np.complex128],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("codec", CODECS)
def test_decode_run_is_decode_of_each_block(codec, dtype):
    """A load of a local file decodes a read's blocks by one `decode_run`: the same bytes as `decode`
    of each block, and a corrupt block of the run is a CorruptCheckpointError naming that block."""
    k = np.dtype(dtype).itemsize
    x = _values(dtype, 5000, seed=7)
    raw = x.view(np.uint8)
    block = 1024 * k
    stored = [bytes(b) for b in _codecs.encode_run(codec, raw, block, dtype)]
    sizes = [min(block, raw.nbytes - o) for o in range(0, raw.nbytes, block)]
    out = np.empty(raw.nbytes, np.uint8)
    names = [f"ck: block {i}" for i in range(len(stored))]
    _codecs.decode_run(codec, stored, dtype, sizes, out, names)
    assert out.tobytes() == raw.tobytes()
    if codec == "none":
        return
    bad = list(stored)
    bad[2] = bytes([bad[2][0] ^ 0x40]) + bad[2][1:]  # the planes header's k, or the zstd magic
    with pytest.raises(CorruptCheckpointError, match="ck: block 2"):
        _codecs.decode_run(codec, bad, dtype, sizes, out, names)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_decode_run_of_blocks_coding_different_planes(dtype):
    """`decode_run` decodes a run in segments of blocks that code the same planes: a run whose
    blocks code different planes (zeros, normals, near-random bytes) and end in a short block
    decodes to the same bytes as `decode` of each block, and a frame that zstd cannot decode in
    any segment is a CorruptCheckpointError naming its own block."""
    k = np.dtype(dtype).itemsize
    n = 2048
    rng = np.random.default_rng(3)
    parts = [np.zeros(n, dtype), _values(dtype, n, seed=1), _values(dtype, n, seed=2),
             rng.integers(0, 256, n * k, dtype=np.uint8).view(dtype), _values(dtype, n, seed=4),
             _values(dtype, n // 3, seed=5)]
    raw = np.concatenate(parts).view(np.uint8)
    stored = [bytes(b) for b in _codecs.encode_run("planes", raw, n * k, dtype)]
    sizes = [p.nbytes for p in parts]
    masks = {struct.unpack_from("<BH", s)[1] for s in stored}
    assert len(masks) >= 3  # the run is several segments
    names = [f"ck: block {i}" for i in range(len(stored))]
    out = np.empty(raw.nbytes, np.uint8)
    _codecs.decode_run("planes", stored, dtype, sizes, out, names)
    assert out.tobytes() == raw.tobytes()
    for victim in (1, 4):
        # the first byte of the block's coded frames whose flip passes the header checks and zstd rejects
        mask = struct.unpack_from("<BH", stored[victim])[1]
        head = 3 + 4 * bin(mask).count("1")
        for pos in range(head + 6, len(stored[victim])):
            bad_block = bytearray(stored[victim])
            bad_block[pos] ^= 0xFF
            try:
                _codecs._planes_layout(memoryview(bytes(bad_block)), sizes[victim], k, "")
            except CorruptCheckpointError:
                continue  # a header, not the coded bytes
            try:
                _codecs.decode("planes", bytes(bad_block), dtype, sizes[victim], where="one")
            except CorruptCheckpointError:
                break
        else:
            pytest.fail("no flipped byte that zstd rejects")
        bad = list(stored)
        bad[victim] = bytes(bad_block)
        with pytest.raises(CorruptCheckpointError, match=f"ck: block {victim}\\b"):
            _codecs.decode_run("planes", bad, dtype, sizes, out, names)


# ------------------------------------------------------------------------------------ blosc2
# "blosc2" and "blosc2-lz4": one C-Blosc2 chunk per block, each codec with its settings (`blosc2lib.SETTINGS`).


@pytest.fixture(params=["direct", "python"])
def blosc2_path(request, monkeypatch):
    """Each C-Blosc2 test both ways: C-Blosc2 called directly (`blosc2lib`, what a save and a load use where
    it loads) and python-blosc2's compress2/decompress2 (what they use where it does not)."""
    if request.param == "python":
        monkeypatch.setattr(blosc2lib, "_loaded", [None])
    else:
        assert blosc2lib.load(_codecs._blosc2()) is not None, "C-Blosc2 is not callable directly beside python-blosc2"
    return request.param


def _blosc2_block(codec: str, dtype, n: int) -> tuple[bytes, int]:
    raw = _values(dtype, n, seed=11).view(np.uint8)
    return _codecs.encode(codec, raw, dtype), raw.nbytes


def _names_its_codec(codec: str, chunk: bytes, k: int) -> None:
    """`chunk`'s header names `codec`'s settings: its element size, one filter (the codec's) and the codec's
    compressor (a chunk of at least 32 bytes, BLOSC_MIN_BUFFERSIZE; a shorter one is stored as it is)."""
    filter_, compressor = B2_HEADER[codec]
    assert chunk[3] == k and chunk[16:22] == bytes([filter_, 0, 0, 0, 0, 0]), (codec, chunk[:32].hex())
    assert chunk[2] >> 5 == compressor, (codec, chunk[:32].hex())


@NEEDS_BLOSC2
@pytest.mark.parametrize("codec", B2)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_blosc2_chunks_of_every_dtype_and_a_short_last_block(codec, dtype, blosc2_path):
    """A leaf's chunk coded as 1 MiB blocks and a short last one: each a Blosc2 chunk of the dtype's
    itemsize with its codec's filter and compressor ("blosc2": byte shuffle and zstd, "blosc2-lz4": bit
    shuffle and LZ4), whose stored bytes decode back bit for bit, run or block, and with python-blosc2's
    plain `decompress2` (docs/FORMAT.md §6.4: a reader needs no more than that)."""
    k = np.dtype(dtype).itemsize
    x = _values(dtype, (1 << 20) // k + 1234, seed=12)
    raw = x.view(np.uint8)
    block = 1 << 20
    stored = _codecs.encode_run(codec, raw, block, dtype)
    assert len(stored) == 2 and len(stored[1]) < len(stored[0])
    for s in stored:
        _names_its_codec(codec, bytes(s), k)
    sizes = [block, raw.nbytes - block]
    out = np.empty(raw.nbytes, np.uint8)
    _codecs.decode_run(codec, stored, dtype, sizes, out)
    assert out.tobytes() == raw.tobytes()
    assert bytes(_codecs.decode(codec, stored[1], dtype, sizes[1])) == raw[block:].tobytes()
    b2 = _codecs._blosc2()
    assert [b2.decompress2(bytes(s)) for s in stored] == [raw[:block].tobytes(), raw[block:].tobytes()]


@NEEDS_BLOSC2
@pytest.mark.parametrize("codec", B2)
def test_a_blosc2_chunk_is_plain_python_blosc2(codec, blosc2_path):
    """The format's promise (docs/FORMAT.md §6.4): a block of either C-Blosc2 codec, as cairn writes it
    (directly or through python-blosc2), is a chunk that python-blosc2's `decompress2` alone, told nothing
    of its codec, filter or element size, decodes to the raw bytes, for element sizes 1-16, odd lengths,
    sizes about the Blosc block the tuner picks, the stored-as-is sizes under 32 bytes, zeros and noise;
    an empty block is a chunk of no bytes."""
    b2 = _codecs._blosc2()
    rng = np.random.default_rng(21)
    for dtype in (np.uint8, ml_dtypes.bfloat16, np.float32, np.float64, np.complex128):
        k = np.dtype(dtype).itemsize
        split = blosc2lib.SETTINGS[codec].split_block
        for n in (0, 1, 3, 31 // k, 1001, split - 1, split, split + 1, 2 * split + 7):
            for raw in (_values(dtype, n, seed=n).view(np.uint8), np.zeros(n * k, np.uint8),
                        rng.integers(0, 256, n * k, dtype=np.uint8)):
                stored = _codecs.encode(codec, raw, dtype)
                assert b2.decompress2(stored) == raw.tobytes(), (np.dtype(dtype).name, n)
                assert bytes(_codecs.decode(codec, stored, dtype, raw.nbytes)) == raw.tobytes()
                assert stored == b2.compress2(raw, **_codecs._blosc2_params(codec, k))
                if raw.nbytes >= 32:
                    _names_its_codec(codec, stored, k)


@NEEDS_BLOSC2
@pytest.mark.parametrize("codec", B2)
def test_the_direct_path_and_python_blosc2_code_the_same_bytes(codec, monkeypatch):
    """C-Blosc2 called directly and python-blosc2's compress2 give the same stored bytes, block for block,
    for every element size 1-16, odd block and run lengths, one run or a batch (`encode_run`,
    `encode_runs`): a checkpoint's bytes do not depend on which path a process took."""
    assert blosc2lib.load(_codecs._blosc2()) is not None
    runs = []
    for i, dtype in enumerate((np.uint8, np.int16, ml_dtypes.bfloat16, np.float32, np.float64, np.complex128)):
        k = np.dtype(dtype).itemsize
        x = _values(dtype, 70_001 + 333 * i, seed=60 + i)
        for block in (k, 37 * k, 4096, 96 << 10, 1 << 20):
            runs.append((codec, x.view(np.uint8), block, dtype))
    direct = [[bytes(b) for b in _codecs.encode_run(c, raw, block, dt)] for c, raw, block, dt in runs]
    batch = [[bytes(b) for b in blocks] for blocks in _codecs.encode_runs(runs, coders=_codecs.BLOSC2_JOIN_MIN_CODERS)]
    monkeypatch.setattr(blosc2lib, "_loaded", [None])
    python = [[bytes(b) for b in _codecs.encode_run(c, raw, block, dt)] for c, raw, block, dt in runs]
    assert direct == python and batch == python
    assert sum(len(blocks) for blocks in python) > 100


@NEEDS_BLOSC2
@pytest.mark.parametrize("mix", [("blosc2",), ("blosc2-lz4",), B2], ids=["blosc2", "blosc2-lz4", "both"])
@pytest.mark.parametrize("blosc2_path, join", [("direct", 1), ("python", 0), ("python", 1), ("python", 3000),
                                               ("python", 1 << 20)], indirect=["blosc2_path"],
                         ids=["direct", "python-join0", "python-join1", "python-join3000", "python-join1M"])
def test_a_batch_of_blosc2_runs_is_compress2_of_each_block(monkeypatch, join, blosc2_path, mix):
    """Small leaves coded together (`encode_runs`) by many coders: their C-Blosc2 blocks ("blosc2",
    "blosc2-lz4", or runs of both in one batch) are coded into one buffer (the direct path) or gathered
    into shared buffers (python-blosc2's: `BLOSC2_JOIN_BYTES`, after every chunk, every few, or one buffer
    for the batch; 0: none), and each block must still be exactly python-blosc2's `compress2` of it with
    its run's codec's settings, in its run, in order, unchanged once later blocks are coded (a view never
    spans or aliases another block's bytes)."""
    monkeypatch.setattr(_codecs, "BLOSC2_JOIN_BYTES", join)
    b2 = _codecs._blosc2()
    runs = []
    for i, dtype in enumerate([ml_dtypes.bfloat16, np.float32, np.float64, np.uint8, ml_dtypes.bfloat16]):
        k = np.dtype(dtype).itemsize
        x = _values(dtype, 3000 + 911 * i, seed=20 + i)
        runs.append((mix[i % len(mix)], x.view(np.uint8), 1024 * k, dtype))  # 3-7 blocks, a short last one
    runs.insert(2, ("planes", _values(np.float32, 700, seed=30).view(np.uint8), 1024, np.float32))  # other codecs between
    runs.insert(3, (mix[-1], np.zeros(0, np.uint8), 64, np.float32))  # an empty chunk
    got = _codecs.encode_runs(runs, coders=_codecs.BLOSC2_JOIN_MIN_CODERS)
    assert len(got) == len(runs)
    if join and blosc2_path == "python":  # with fewer coders, python-blosc2's chunks as they came
        assert all(type(b) is bytes for (c, *_), blocks in zip(runs, _codecs.encode_runs(runs)) if c in B2
                   for b in blocks)
    for (codec, raw, block, dtype), blocks in zip(runs, got):
        want = [b2.compress2(raw[o:o + block], **_codecs._blosc2_params(codec, np.dtype(dtype).itemsize))
                if codec in B2 else _codecs.encode(codec, raw[o:o + block], dtype)
                for o in range(0, raw.nbytes, block)]
        assert [bytes(b) for b in blocks] == want
        for b in blocks:
            assert memoryview(b).format == "B" and memoryview(b).contiguous
            if codec in B2:
                _names_its_codec(codec, bytes(b), np.dtype(dtype).itemsize)
    views = [b for blocks in got for b in blocks if isinstance(b, memoryview)]
    if blosc2_path == "direct":  # every chunk of the batch in one buffer, back to back, in order
        coded = [b for (c, *_), blocks in zip(runs, got) if c in B2 for b in blocks]
        assert all(isinstance(b, memoryview) and b.obj is coded[0].obj for b in coded)
        starts = [np.frombuffer(b, np.uint8).__array_interface__["data"][0] for b in coded if len(b)]
        assert starts == [starts[0] + sum(len(b) for b in coded[:i]) for i in range(len(coded))]
    elif join:
        assert views  # gathered: views of shared buffers, not python-blosc2's bytes


@pytest.mark.parametrize("codec", ["planes", "zstd"])
def test_a_batch_coded_into_lent_buffers_is_the_same_batch(monkeypatch, codec):
    """`encode_runs(..., alloc=)` (a save lends its coders buffers from a `SlabPool`): the same blocks, byte
    for byte, in buffers from `alloc`, and buffers taken back and lent again for later batches change
    nothing that a still-held block shows (a block's view keeps its buffer lent)."""
    _lent_batch_is_the_same_batch(monkeypatch, codec)


@NEEDS_BLOSC2
@pytest.mark.parametrize("codec", B2)
def test_a_blosc2_batch_coded_into_lent_buffers_is_the_same_batch(monkeypatch, blosc2_path, codec):
    """The same for each C-Blosc2 codec, both ways (C-Blosc2 directly into the lent buffer; python-blosc2's
    chunks gathered into it)."""
    _lent_batch_is_the_same_batch(monkeypatch, codec)


def _lent_batch_is_the_same_batch(monkeypatch, codec: str) -> None:
    from cairn._core.buffers import SlabPool

    monkeypatch.setattr(_codecs, "JOIN_NUMPY_BYTES", 1)  # planes and zstd join into one numpy buffer too
    runs = []
    for i, dtype in enumerate([ml_dtypes.bfloat16, np.float32, np.float64, np.float32]):
        k = np.dtype(dtype).itemsize
        runs.append((codec, _values(dtype, 5000 + 777 * i, seed=40 + i).view(np.uint8), 2048 * k, dtype))
    coders = _codecs.BLOSC2_JOIN_MIN_CODERS
    want = [[bytes(b) for b in blocks] for blocks in _codecs.encode_runs(runs, coders=coders)]
    pool = SlabPool()
    asked: list[int] = []

    def alloc(n: int) -> np.ndarray:
        asked.append(n)
        return pool.lend(n)

    got = _codecs.encode_runs(runs, coders=coders, alloc=alloc)
    assert asked and [[bytes(b) for b in blocks] for blocks in got] == want
    for _ in range(3):  # lent again and again while `got` is held: it must not see the new batches' bytes
        _codecs.encode_runs(runs[:0:-1], coders=coders, alloc=alloc)
    assert [[bytes(b) for b in blocks] for blocks in got] == want
    assert pool.reused > 0 and pool.made >= 2


@NEEDS_BLOSC2
@pytest.mark.parametrize("codec", B2)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_blosc2_corrupt_bytes_raise(codec, dtype, blosc2_path):
    """A changed byte anywhere in a C-Blosc2 block (header or streams) is a CorruptCheckpointError naming
    the block, or (where only the CRC could tell) decodes to exactly the raw size; never a crash."""
    stored, size = _blosc2_block(codec, dtype, 3000)
    for i in range(len(stored)):
        bad = bytearray(stored)
        bad[i] ^= 0x5A
        _decodes_or_raises(codec, bytes(bad), dtype, size)
    for i in (2, 3, 4, 12, 16, 31):  # flags, typesize, nbytes, cbytes, filters, blosc2 flags
        bad = bytearray(stored)
        bad[i] ^= 0x40
        with pytest.raises(CorruptCheckpointError, match="ckpt/params.w"):
            _codecs.decode(codec, bytes(bad), dtype, size, where="ckpt/params.w")
    with pytest.raises(CorruptCheckpointError, match="byte elements where its dtype"):
        _codecs.decode(codec, stored, np.float64 if dtype == np.float32 else np.float32, size)


@NEEDS_BLOSC2
@pytest.mark.parametrize("codec", B2)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_blosc2_run_checks_every_header_as_decode_does(codec, dtype, blosc2_path):
    """`decode_run` checks each block of a run of C-Blosc2 blocks as `decode` does: a changed byte in any
    block of a run (every bit of each header, bytes of the streams, random bytes) raises exactly when
    `decode` of that block raises, naming that block, and never another error; intact runs, given as
    bytes, memoryviews or numpy arrays, decode bit for bit."""
    k = np.dtype(dtype).itemsize
    raws = [_values(dtype, n, seed=20 + n).view(np.uint8) for n in (3000, 2048, 777)]
    good = [_codecs.encode(codec, r, dtype) for r in raws]
    sizes = [r.nbytes for r in raws]
    names = [f"ckpt/params.w block {i}" for i in range(3)]
    want = np.concatenate(raws).tobytes()
    for form in (bytes, memoryview, lambda b: np.frombuffer(b, np.uint8)):
        out = np.empty(sum(sizes), np.uint8)
        _codecs.decode_run(codec, [form(b) for b in good], dtype, sizes, out, names)
        assert out.tobytes() == want

    raised = []

    def same_as_decode(blocks: list[bytes]) -> None:
        first_bad = None
        for i, b in enumerate(blocks):
            try:
                _codecs.decode(codec, b, dtype, sizes[i], where=names[i])
            except CorruptCheckpointError:
                first_bad = i
                break
        out = np.empty(sum(sizes), np.uint8)
        if first_bad is None:
            _codecs.decode_run(codec, blocks, dtype, sizes, out, names)
            return
        raised.append(first_bad)
        with pytest.raises(CorruptCheckpointError, match=f"block {first_bad}:"):
            _codecs.decode_run(codec, [memoryview(b) for b in blocks], dtype, sizes, out, names)

    rng = np.random.default_rng(3)
    for b in range(3):
        places = list(range(32)) + sorted(rng.choice(np.arange(32, len(good[b])), 16, replace=False).tolist())
        for i in places:
            for bit in range(8) if i < 32 else (0, 5):
                bad = bytearray(good[b])
                bad[i] ^= 1 << bit
                same_as_decode([bytes(bad) if j == b else good[j] for j in range(3)])
        for cut in (0, 5, 31, 32, len(good[b]) - 1):
            same_as_decode([good[b][:cut] if j == b else good[j] for j in range(3)])
        noise = rng.integers(0, 256, len(good[b]), dtype=np.uint8).tobytes()
        same_as_decode([noise if j == b else good[j] for j in range(3)])
    assert set(raised) == {0, 1, 2}  # every block's damage was seen and named
    with pytest.raises(CorruptCheckpointError, match="block 1:.*raw size"):
        _codecs.decode_run(codec, good, dtype, [sizes[0], sizes[1] + 1, sizes[2]], np.empty(sum(sizes) + 1, np.uint8),
                           names)
    assert k in (2, 4)


@NEEDS_BLOSC2
@pytest.mark.parametrize("form", ["a blosc2-lz4 chunk", "a blosc2 chunk's filter byte"])
def test_a_blosc2_block_with_the_bit_shuffle_is_rejected(form, blosc2_path):
    """The bit shuffle (Blosc filter 2) is "blosc2-lz4"'s (format version 6): a block named "blosc2" whose
    header names it, whether a "blosc2-lz4" chunk or a "blosc2" chunk with its filter byte changed, is a
    CorruptCheckpointError naming the block, the filters it names and those "blosc2" allows, by `decode`
    and by `decode_run`, before anything is decoded; the "blosc2-lz4" chunk itself decodes as its codec."""
    raw = _values(np.float32, 3000, seed=5).view(np.uint8)
    if form == "a blosc2-lz4 chunk":
        stored = _codecs.encode("blosc2-lz4", raw, np.float32)
        assert bytes(_codecs.decode("blosc2-lz4", stored, np.float32, raw.nbytes)) == raw.tobytes()
    else:
        chunk = bytearray(_codecs.encode("blosc2", raw, np.float32))
        assert chunk[16] == 1
        chunk[16] = 2
        stored = bytes(chunk)
    assert stored[16:22] == bytes([2, 0, 0, 0, 0, 0])
    why = (r"names Blosc filters \[2, 0, 0, 0, 0, 0\] "
           r"\(cairn reads \(0, 1\) in 'blosc2' blocks: none, shuffle\)")
    with pytest.raises(CorruptCheckpointError, match=r"ckpt/params\.w: .*" + why):
        _codecs.decode("blosc2", stored, np.float32, raw.nbytes, where="ckpt/params.w")
    good = _codecs.encode("blosc2", raw, np.float32)
    with pytest.raises(CorruptCheckpointError, match=r"ckpt/params\.w block 1: .*" + why):
        _codecs.decode_run("blosc2", [good, stored], np.float32, [raw.nbytes] * 2, np.empty(2 * raw.nbytes, np.uint8),
                           ["ckpt/params.w block 0", "ckpt/params.w block 1"])


@NEEDS_BLOSC2
@pytest.mark.parametrize("codec", B2)
def test_each_blosc2_codec_reads_the_filters_its_spec_allows(codec, blosc2_path):
    """docs/FORMAT.md §6.4: "blosc2" blocks may name filters 0 (none) and 1 (the byte shuffle), "blosc2-lz4"
    blocks 0, 1 and 2 (the bit shuffle); a chunk naming any other built-in filter (3, the delta filter;
    4, the precision truncation; 6, a byte delta) is corrupt, naming the filters each codec reads. Chunks
    of each allowed filter, as python-blosc2 codes them, decode bit for bit."""
    b2 = _codecs._blosc2()
    allowed = {"blosc2": (0, 1), "blosc2-lz4": (0, 1, 2)}[codec]
    raw = _values(np.float32, 3000, seed=6).view(np.uint8)
    kw = dict(_codecs._blosc2_params(codec, 4))
    for f in allowed:
        chunk = b2.compress2(raw, **dict(kw, filters=[b2.Filter(f)]))
        assert chunk[16] == f and bytes(_codecs.decode(codec, chunk, np.float32, raw.nbytes)) == raw.tobytes()
    names = "none, shuffle, bit shuffle" if codec == "blosc2-lz4" else "none, shuffle"
    for f in (3, 4, 6):
        bad = bytearray(_codecs.encode(codec, raw, np.float32))
        bad[16] = f
        why = (rf"names Blosc filters \[{f}, 0, 0, 0, 0, 0\] "
               rf"\(cairn reads \({', '.join(map(str, allowed))}\) in '{codec}' blocks: {names}\)")
        with pytest.raises(CorruptCheckpointError, match=why):
            _codecs.decode(codec, bytes(bad), np.float32, raw.nbytes)


@pytest.mark.parametrize("codec", B2)
def test_blosc2_missing_names_the_block_and_the_extra(monkeypatch, codec):
    """Reading a C-Blosc2 block without python-blosc2: an error that names the block, the library and
    what to install, not a corrupt checkpoint; coding one says what to install."""
    import sys

    from cairn._errors import CheckpointError

    monkeypatch.setattr(_codecs, "_blosc2_module", None)
    monkeypatch.setattr(blosc2lib, "_loaded", [])  # (a fresh process's: nothing found yet)
    monkeypatch.setattr(blosc2lib, "_decoding", [])
    monkeypatch.setattr(blosc2lib, "_encoding", [])
    monkeypatch.setitem(sys.modules, "blosc2", None)  # import blosc2 -> ImportError; find_spec -> None
    with pytest.raises(CheckpointError, match=rf"ckpt/params\.w.*'{codec}' codec.*python-blosc2.*cairn-ckpt\[fast\]") as e:
        _codecs.decode(codec, b"\0" * 64, np.float32, 64, where="ckpt/params.w")
    assert not isinstance(e.value, CorruptCheckpointError)
    with pytest.raises(CheckpointError, match="cairn-ckpt"):
        _codecs.encode(codec, np.zeros(16, np.uint8), np.float32)
    with pytest.raises(CheckpointError, match=rf"ckpt/b\.w: the '{codec}' codec.*cairn-ckpt\[fast\]"):
        _codecs.decode_run(codec, [b"\0" * 64], np.float32, [64], np.empty(64, np.uint8), ["ckpt/b.w"])


def test_choose_takes_blosc2_only_where_it_is_importable(monkeypatch):
    x = _values(np.float32, 1 << 16, seed=13)
    monkeypatch.setattr(_codecs, "_blosc2_found", False)
    assert _choose.choose(np.float32, x) == "planes"
    if HAVE_BLOSC2:
        monkeypatch.setattr(_codecs, "_blosc2_found", True)
        assert _choose.choose(np.float32, x) == "blosc2"


@pytest.mark.parametrize("codec", CODECS)
def test_stored_size_is_the_blocks_of_a_mib(codec):
    """`stored_size` (what "auto" weighs codecs by): the stored bytes of the sample cut into 1 MiB pieces
    (whole elements), each coded as a block, a trailing part of an element left out."""
    for dtype in (np.float32, np.complex128, ml_dtypes.bfloat16):
        k = np.dtype(dtype).itemsize
        raw = _values(dtype, (5 << 19) // k + 3).view(np.uint8)  # 2.5 MiB and 3 elements: 3 pieces
        step = (1 << 20) - (1 << 20) % k
        want = sum(len(_codecs.encode(codec, raw[o:o + step], dtype)) for o in range(0, raw.nbytes, step))
        assert _choose.stored_size(codec, dtype, raw.view(dtype)) == want
        assert _choose.stored_size(codec, dtype, np.concatenate([raw, raw[:k - 1]])) == want  # a partial element
    assert _choose.stored_size(codec, np.float32, np.zeros(0, np.float32)) == 0
