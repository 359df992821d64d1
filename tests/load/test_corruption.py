"""Corruption: every byte of a checkpoint flipped, or any file truncated, never loads wrong values.

A flip or truncation anywhere (manifest, index, data files) must give
`CorruptCheckpointError` or a clean `CheckpointNotFoundError`, or (where the
byte carries nothing a load returns, e.g. the creation time) the exact
original values; never different values and never a crash of the
interpreter. The manifest and index parsers are fuzzed with hypothesis, and
size claims are checked before anything is allocated: an index claiming a
1 PB array fails with RSS unchanged.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cairn
from _forge import as_explicit, as_version_1
from _trees import assert_same
from cairn._format import manifest as fmt

STRESS = os.environ.get("CAIRN_STRESS") == "1"
pytestmark = pytest.mark.timeout(600)


def state():
    rng = np.random.default_rng(7)
    return {
        "params": {"w": rng.standard_normal((8, 6)).astype(np.float32), "b": np.arange(5, dtype=np.int64)},
        "opt": {"count": 7, "lr": 0.125, "name": "adam", "flag": True, "none": None,
                "big": 2**70, "z": np.float32(1.5), "blob": b"\x00\x01payload"},
    }




@pytest.fixture(scope="module", params=[False, "zstd", "planes"])
def pristine(tmp_path_factory, request):
    """The checkpoint raw (format version 2) and with every array compressed (version 3)."""
    path = tmp_path_factory.mktemp("corrupt") / "ckpt"
    cairn.save(path, state(), user_metadata={"note": "original"}, compression=request.param)
    return path


def files_of(path):
    out = []
    for dirpath, _d, names in os.walk(path):
        for n in names:
            out.append(os.path.relpath(os.path.join(dirpath, n), path))
    return sorted(out)


def classify(rel: str) -> str:
    if rel == fmt.MANIFEST:
        return "manifest"
    if rel.endswith(".bin") and not os.path.basename(rel).startswith("index."):
        return "data"
    return "index"


def outcome(path) -> str:
    """Load everything and read the manifest metadata: 'corrupt', 'not-found' or 'same'."""
    try:
        out = cairn.load(path)
        meta = cairn._load.engine.read_manifest(cairn._storage.location.resolve(path)).metadata
    except cairn.CorruptCheckpointError:
        return "corrupt"
    except cairn.CheckpointNotFoundError:
        return "not-found"
    assert_same(out, state(), str(path))
    assert meta == {"note": "original"}, meta
    return "same"


def positions(n: int, rng) -> list[int]:
    """Every byte of small files; for larger ones the first and last 64 and a random sample."""
    if n <= 4096 or STRESS:
        return list(range(n))
    inner = rng.choice(np.arange(64, n - 64), size=512, replace=False)
    return sorted({*range(64), *range(n - 64, n), *map(int, inner)})


def test_every_byte_flipped(pristine, tmp_path):
    rng = np.random.default_rng(0)
    work = tmp_path / "ckpt"
    shutil.copytree(pristine, work)
    tally: dict[str, dict[str, int]] = {}
    for rel in files_of(pristine):
        original = (pristine / rel).read_bytes()
        kind = classify(rel)
        for pos in positions(len(original), rng):
            # One random bit under normal runs; every bit under stress.
            masks = [1 << b for b in range(8)] if STRESS else [1 << int(rng.integers(8))]
            for mask in masks:
                bad = bytearray(original)
                bad[pos] ^= mask
                (work / rel).write_bytes(bytes(bad))
                try:
                    got = outcome(work)
                except AssertionError as e:
                    raise AssertionError(f"{rel} byte {pos} ^ {mask:#x} loaded wrong values: {e}") from None
                tally.setdefault(kind, {}).setdefault(got, 0)
                tally[kind][got] += 1
        (work / rel).write_bytes(original)
    print("\nflips:", json.dumps(tally))
    # Data bytes are all covered by checksums.
    assert set(tally["data"]) == {"corrupt"}, tally
    assert tally["manifest"].get("corrupt", 0) > 0 and tally["index"].get("corrupt", 0) > 0


def test_every_truncation(pristine, tmp_path):
    work = tmp_path / "ckpt"
    shutil.copytree(pristine, work)
    n = 0
    for rel in files_of(pristine):
        original = (pristine / rel).read_bytes()
        for size in range(len(original)) if len(original) <= 4096 or STRESS else \
                [*range(0, len(original), max(1, len(original) // 300)), len(original) - 1]:
            (work / rel).write_bytes(original[:size])
            got = outcome(work)
            assert got in ("corrupt", "not-found"), f"{rel} truncated to {size} bytes loaded ({got})"
            n += 1
        (work / rel).unlink()
        assert outcome(work) in ("corrupt", "not-found"), f"{rel} removed"
        (work / rel).write_bytes(original)
    assert outcome(work) == "same"
    print(f"\ntruncations: {n}")


# ---------------------------------------------------------------------- crafted metadata with valid checksums


def index_file(path, item: str):
    m = json.loads((path / fmt.MANIFEST).read_bytes())
    return path / m["items"][item]["dir"] / m["items"][item]["index"]


def rewrite(file, edit) -> None:
    """Apply `edit` to the parsed JSON of `file` and write it back with a valid checksum."""
    doc = json.loads(file.read_bytes())
    doc.pop("crc32c", None)
    edit(doc)
    file.write_bytes(fmt.dump_checked_json(doc))


@pytest.fixture
def allocations(monkeypatch):
    """Every read buffer the loader allocates, in bytes."""
    sizes: list[int] = []
    real = cairn._core.buffers.aligned_empty

    def spy(shape, dtype, align=64, **kw):
        sizes.append(int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize)
        return real(shape, dtype, align, **kw)

    monkeypatch.setattr(cairn._load.reader, "aligned_empty", spy)  # where the chunk reader looks it up
    return sizes


@pytest.mark.parametrize("claim_file_size", [True, False])
def test_petabyte_array_claim_allocates_nothing(tmp_path, allocations, claim_file_size):
    psutil = pytest.importorskip("psutil")
    path = tmp_path / "ckpt"
    cairn.save(path, {"x": {"w": np.zeros(1024, np.float32)}})
    as_version_1(path)  # an explicit chunk table, forged below
    pb = 1 << 50
    block = fmt.MAX_BLOCK  # the fewest checksums a 1 PB chunk can have: 2^20

    def edit(doc):
        doc["block_size"] = block
        leaf = doc["leaves"][0]
        leaf["shape"], leaf["grid"] = [pb // 4], [[0, pb // 4]]
        leaf["chunks"] = [[0, 0, *([0] * fmt.num_blocks(pb, block))]]
        if claim_file_size:  # the index lies about its data file too
            doc["files"][0]["size"] = pb

    rewrite(index_file(path, "x"), edit)
    import gc

    gc.collect()  # measure this load only, not garbage other tests left behind
    rss = psutil.Process().memory_info().rss
    with pytest.raises(cairn.CorruptCheckpointError, match="claims|outside its data file") as e:
        cairn.load(path)
    assert str(path) in str(e.value)
    assert allocations == []
    gc.collect()
    assert psutil.Process().memory_info().rss - rss < 256 << 20
    with pytest.raises(cairn.CorruptCheckpointError):
        cairn.load(path, {"x": {"w": cairn.ArrayMetadata((pb // 4,), np.dtype(np.float32), pb)}})


def json_values():
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70),
        st.sampled_from([0, 1, -1, 2**31, 2**56, 2**63, -(2**63), 10**30]),
        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
        st.sampled_from(["float32", "object", "../../x", "p00000-0.x.bin", "pytree", "array", "int", "bytes"]),
    )
    return st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                                             max_size=4), max_leaves=12)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


@pytest.fixture(scope="module", params=["raw", "compressed"])
def fuzz_dir(tmp_path_factory, request):
    """Raw, and compressed with every chunk in the JSON index (so the fuzz reaches each block's
    `stored` size and the `codec` of format version 3)."""
    path = tmp_path_factory.mktemp("fuzz") / "ckpt"
    if request.param == "raw":
        cairn.save(path, state(), user_metadata={"note": "original"})
    else:
        cairn.save(path, state(), user_metadata={"note": "original"}, compression="zstd")
        as_explicit(path)
        assert b'"stored"' in index_file(path, "params").read_bytes()
    return path


@settings(max_examples=2000 if STRESS else 200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_checksummed_metadata_mutations(fuzz_dir, allocations, data):
    """Any one field of a manifest or index replaced (or dropped), with a valid checksum: a clean error."""
    target = data.draw(st.sampled_from([fuzz_dir / fmt.MANIFEST, index_file(fuzz_dir, "params"),
                                        index_file(fuzz_dir, "opt")]))
    original = target.read_bytes()
    doc = json.loads(original)
    doc.pop("crc32c")
    where = data.draw(st.sampled_from([p for p in _paths(doc) if p]))
    drop = data.draw(st.booleans())
    value = None if drop else data.draw(json_values())

    def edit(d):
        node = d
        for p in where[:-1]:
            node = node[p]
        if drop and isinstance(node, dict):
            del node[where[-1]]
        else:
            node[where[-1]] = value

    data_bytes = sum(os.path.getsize(os.path.join(dp, n)) for dp, _, ns in os.walk(fuzz_dir) for n in ns
                     if n.endswith(".bin"))
    allocations.clear()
    try:
        rewrite(target, edit)
        cairn.load(fuzz_dir)
        cairn.metadata(fuzz_dir)
    except cairn.CheckpointError:
        pass  # corrupt, not found, mismatch: all clean
    finally:
        target.write_bytes(original)
    # Buffers are bounded by what is really on disk, whatever the metadata claims.
    assert sum(allocations) <= data_bytes, (where, value, allocations)


# ------------------------------------------------------------------ sparse deltas (FORMAT.md §6.5, kind 1)


def _sparse_case(content: bytes, kind: int = 1, pad: int = 0, base_codec: int = 0):
    """A 4 KiB bf16 base block and a delta against it whose zstd frame holds `content`."""
    import zstandard

    from cairn._core.checksum import crc32c
    from cairn._format.blocks import DELTA_HEADER

    base = np.arange(2048, dtype=np.uint16).view(np.uint8)
    head = DELTA_HEADER.pack(base_codec, kind, pad, crc32c(base), base.nbytes)
    return head + zstandard.ZstdCompressor(write_content_size=True).compress(content), base


def _sparse_content(gaps: list[int], values: list[int], n: int | None = None) -> bytes:
    return (np.array([len(gaps) if n is None else n], "<u4").tobytes() + np.array(gaps, "<u4").tobytes()
            + np.array(values, "<u2").tobytes())


def _undelta(stored: bytes, base: np.ndarray) -> np.ndarray:
    import ml_dtypes

    from cairn._load.blocks import undelta

    out = np.empty(base.nbytes, np.uint8)
    undelta(stored, base.nbytes, ml_dtypes.bfloat16, lambda size, codec: base[:size], out, "ckpt: leaf 'w' block 0")
    return out


def test_a_sparse_delta_overwrites_its_changed_elements():
    stored, base = _sparse_case(_sparse_content([0, 5, 2042], [7, 8, 9]))  # indices 0, 5, 2047
    want = base.view(np.uint16).copy()
    want[[0, 5, 2047]] = [7, 8, 9]
    assert _undelta(stored, base).tobytes() == want.tobytes()
    stored, base = _sparse_case(_sparse_content([], []))  # no element changed
    assert _undelta(stored, base).tobytes() == base.tobytes()


@pytest.mark.parametrize("case, match", [
    (dict(kind=2), "names kind 2"),
    (dict(pad=1), "pad bytes 0x0001"),
    (dict(pad=0x100), "pad bytes 0x0100"),
    (dict(content=_sparse_content([1, 2], [3, 4], n=3)), "names 3 changed elements"),  # n disagrees with the size
    (dict(content=_sparse_content([0] + [1] * 2048, [1] * 2049)), "declares 12298 decompressed bytes, more than"),
    (dict(content=_sparse_content([1], [1], n=3000)), "names 3000 changed elements of 2 bytes"),  # n > count
    (dict(content=_sparse_content([2048], [1])), "not strictly increasing below 2048"),  # index out of range
    (dict(content=_sparse_content([1000, 1048], [1, 1])), "not strictly increasing below 2048"),  # index 2048
    (dict(content=_sparse_content([3, 0], [1, 1])), "not strictly increasing"),  # a repeated index
    (dict(content=b"\x01\x00"), "shorter than its count"),
    (dict(content=_sparse_content([3], [1]) + b"\x00"), "names 1 changed elements"),
])
def test_corrupt_sparse_deltas_are_named(case, match):
    stored, base = _sparse_case(case.pop("content", _sparse_content([3, 4], [1, 2])), **case)
    with pytest.raises(cairn.CorruptCheckpointError, match=match) as e:
        _undelta(stored, base)
    assert "ckpt: leaf 'w' block 0" in str(e.value)


def test_a_truncated_sparse_delta_frame_is_corrupt():
    stored, base = _sparse_case(_sparse_content([3, 4], [1, 2]))
    for cut in (1, 3, len(stored) - 16 - 1):
        with pytest.raises(cairn.CorruptCheckpointError, match="ckpt: leaf 'w' block 0"):
            _undelta(stored[:-cut], base)


def test_a_sparse_delta_of_an_element_size_without_a_uint_is_corrupt():
    from cairn._load.blocks import undelta

    stored, base = _sparse_case(_sparse_content([3], [1]))
    with pytest.raises(cairn.CorruptCheckpointError, match="sparse deltas have elements of 1, 2, 4 or 8 bytes"):
        undelta(stored, base.nbytes, np.complex128, lambda size, codec: base[:size], np.empty(4096, np.uint8), "ckpt")


# ---------------------------------------------------------------------- delta headers and sparse frames, fuzzed


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=40), st.sampled_from([0, 4096, 1 << 20]))
def test_any_delta_header_is_read_or_refused(data, raw_size):
    """Whatever 16 bytes head a delta block, `delta_header` gives a base codec that is a block codec (never
    a delta), a known kind and a base size within the bound, or raises CorruptCheckpointError."""
    from cairn._format.binindex import stored_bound
    from cairn._format.blocks import CODEC_NAMES, DELTA, DELTA_KINDS
    from cairn._load.blocks import delta_header

    try:
        codec, _crc, size, kind = delta_header(data, raw_size, "ckpt: block 0")
    except cairn.CorruptCheckpointError as e:
        assert "ckpt: block 0" in str(e)
        return
    assert codec < len(CODEC_NAMES) and codec != DELTA and kind < len(DELTA_KINDS)
    assert size <= stored_bound(raw_size) and (codec != 0 or size == raw_size)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=200), st.sampled_from([1, 2, 4, 8]), st.integers(0, 64))
def test_any_sparse_content_is_parsed_or_refused(content, k, count):
    """A sparse delta's decoded content: either n strictly increasing element indices below the block's
    count with n values of k bytes, or a CorruptCheckpointError naming the block."""
    from cairn._format.blocks import sparse_parse, sparse_size

    try:
        idx, values = sparse_parse(np.frombuffer(content, np.uint8), count, k, "ckpt: block 3")
    except cairn.CorruptCheckpointError as e:
        assert "ckpt: block 3" in str(e)
        return
    n = len(idx)
    assert len(content) == sparse_size(n, k) and n <= count and len(values) == n
    assert values.dtype.itemsize == k
    if n:
        assert idx[0] >= 0 and idx[-1] < count and bool(np.all(np.diff(idx) > 0))
