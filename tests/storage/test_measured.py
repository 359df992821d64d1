"""The measured bandwidth rule (`_storage.measured`): fed known byte counts and times, never timed."""

from __future__ import annotations

import pytest

from cairn._storage import measured
from cairn._storage.base import DEFAULT_BANDWIDTH, bandwidth_of, bandwidth_source
from cairn._storage.measured import (
    KEEP,
    MIN_SAMPLE_BYTES,
    LinkMeter,
    Sample,
    TransferClock,
    link_of,
    link_seconds,
    sample_of,
    union_seconds,
)

MiB = 1 << 20


class _Store:
    """Just what `bandwidth_of` and `link_of` look at."""

    in_process = False

    def __init__(self, url: str = "s3://bucket/runs/7", kind: str = "object", bandwidth: float | None = None,
                 config: dict | None = None):
        self.url, self.kind, self.bandwidth = url, kind, bandwidth
        self._config = config or {}


def test_union_of_intervals():
    assert union_seconds([]) == 0
    assert union_seconds([(0, 1), (0.5, 2), (3, 4)]) == 3  # overlapping ones count once
    assert union_seconds([(2, 1), (5, 5)]) == 0  # empty and reversed ones count nothing
    assert union_seconds([(0, 10), (1, 2)]) == 10


def test_link_seconds_leave_out_the_codec_and_count_concurrency_once():
    # Two writers at once for 4 s: one stretch of 4 s, not 8.
    assert link_seconds([(0, 4, []), (0, 4, [])]) == (4, 4)
    # One writer waiting 3 of its 4 s for the codec: the link was busy 1 s.
    assert link_seconds([(0, 4, [(0, 1), (1.5, 3.5)])]) == (pytest.approx(1.0), 4)
    # While one writer waits for its codec, the other's transfer keeps the link busy.
    assert link_seconds([(0, 4, [(0, 2)]), (0, 4, [(2, 4)])]) == (4, 4)
    # Waits reaching outside the transfer are clipped to it.
    assert link_seconds([(1, 3, [(0, 2)])]) == (1, 2)


def test_a_sample():
    assert sample_of(MIN_SAMPLE_BYTES - 1, 1.0, 1.0) is None  # too small to say anything
    assert sample_of(64 * MiB, 1.0, 0.0) is None
    assert sample_of(64 * MiB, 0.5, 1.0) == Sample(link=128 * MiB, wall=64 * MiB, coded=False)
    assert sample_of(64 * MiB, 0.0, 1.0) == Sample(64 * MiB, 64 * MiB, False)  # no link time seen: the wall
    assert sample_of(64 * MiB, 2.0, 1.0) == Sample(64 * MiB, 64 * MiB, False)  # the link within the wall
    assert sample_of(64 * MiB, 1.0, 1.0, coded=True).coded


def test_the_figures_of_a_link():
    m = LinkMeter()
    assert m.bandwidth("l", "write") is None and m.bandwidth("l", "write", coded=True) is None
    with pytest.raises(ValueError, match="direction"):
        m.record("l", "sideways", sample_of(64 * MiB, 1, 1))
    # A coded save, its link busy 0.25 of its 2 s: raw transfers are priced at the link's own
    # figure (optimistic: the next save may try the link raw), coded ones at what it reached.
    m.record("l", "write", sample_of(64 * MiB, 0.25, 2.0, coded=True))
    assert m.bandwidth("l", "write") == 256 * MiB and m.bandwidth("l", "write", coded=True) == 32 * MiB
    # Raw saves measure the raw figure: the median of the last KEEP of them.
    for mib_s in (100, 300, 200):
        m.record("l", "write", sample_of(mib_s * MiB, 1.0, 1.0))
    assert m.bandwidth("l", "write") == 200 * MiB and m.bandwidth("l", "write", coded=True) == 32 * MiB
    for _ in range(KEEP):
        m.record("l", "write", sample_of(50 * MiB, 1.0, 1.0))
    assert m.bandwidth("l", "write") == 50 * MiB  # older samples drop out
    # Reads unmeasured: the writes' figures; measured, their own (a coded load: a coded figure only,
    # the raw one from the writes still).
    assert m.bandwidth("l", "read") == 50 * MiB and m.bandwidth("l", "read", coded=True) == 32 * MiB
    m.record("l", "read", sample_of(400 * MiB, 1.0, 1.0, coded=True))
    assert m.bandwidth("l", "read", coded=True) == 400 * MiB
    assert m.bandwidth("l", "read") == 400 * MiB  # a coded load's figure stands in for raw reads
    m.record("l", "read", sample_of(600 * MiB, 1.0, 1.0))
    assert m.bandwidth("l", "read") == 600 * MiB and m.bandwidth("l", "read", coded=True) == 400 * MiB
    assert m.bandwidth("other", "read") is None
    m.clear()
    assert m.bandwidth("l", "write") is None


def test_links_are_told_apart():
    assert link_of(_Store("s3://b/runs/7")) == link_of(_Store("s3://b/runs/8")) == "object:s3://b"
    a = link_of(_Store(config={"endpoint": "http://127.0.0.1:9000"}))
    b = link_of(_Store(config={"endpoint": "http://127.0.0.1:9001"}))
    assert a != b and "9000" in a
    assert link_of(_Store("/mnt/nfs/runs", kind="network")) == "network:/mnt/nfs/runs"
    assert link_of(_Store("/tmp/x", kind="local")) is None  # a local disk is not measured
    mem = _Store("memory://b/x")
    mem.in_process = True
    assert link_of(mem) is None  # memory:// is a copy, not a link


def test_bandwidth_of_declared_then_measured_then_default():
    store = _Store(config={"endpoint": "http://127.0.0.1:1"})
    assert bandwidth_of(store) == DEFAULT_BANDWIDTH["object"] and bandwidth_source(store) == "default"
    measured.record(store, "write", sample_of(64 * MiB, 0.5, 0.5))
    assert bandwidth_of(store) == 128 * MiB and bandwidth_source(store) == "measured"
    assert bandwidth_of(store, "read") == 128 * MiB  # unmeasured reads: the writes' figure
    measured.record(store, "read", sample_of(64 * MiB, 0.25, 0.25))
    assert bandwidth_of(store, "read") == 256 * MiB
    assert bandwidth_of(store, "write", coded=True) == 128 * MiB  # no coded transfer yet: the raw figure
    measured.record(store, "write", sample_of(64 * MiB, 0.5, 1.0, coded=True))
    assert bandwidth_of(store, "write", coded=True) == 64 * MiB and bandwidth_of(store) == 128 * MiB
    store.bandwidth = 2e9  # a declared figure wins
    assert bandwidth_of(store) == bandwidth_of(store, "read") == 2e9 and bandwidth_source(store) == "declared"
    assert bandwidth_of(_Store("/tmp/x", kind="local")) == DEFAULT_BANDWIDTH["local"]


def test_transfer_clock_times_the_transfer_without_its_producer():
    ticks = iter(range(100))
    clock = TransferClock(clock=lambda: float(next(ticks)))

    def write(key, parts):
        return sum(len(p) for p in parts)

    # start 0; each piece: a wait (1 -> 2), then the next (3 -> 4), the end of parts (5 -> 6); end 7.
    assert clock.transfer(write, "k", [b"ab", b"c"]) == 3
    (start, end, waits), = clock.transfers
    assert (start, end) == (0.0, 7.0) and waits == [(1.0, 2.0), (3.0, 4.0), (5.0, 6.0)]
    assert clock.seconds() == (4.0, 7.0)


def test_coded_figures_are_kept_per_codec():
    """A coded transfer's figure is its codec's too (the codec of most of its bytes): a codec measured
    is priced with its own figure, one not measured yet on a link where others were with the link's raw
    figure (tried, then measured); transfers naming no codec feed only the figure of all codecs."""
    m = LinkMeter()
    assert sample_of(64 * MiB, 1.0, 1.0, coded=True, codec="blosc2").codec == "blosc2"
    assert sample_of(64 * MiB, 1.0, 1.0, codec="blosc2").codec is None  # (a raw transfer has none)
    assert measured.main_codec({"planes": 10, "blosc2": 30, "zstd": 5}) == "blosc2" and measured.main_codec({}) is None
    m.record("l", "write", sample_of(100 * MiB, 1.0, 1.0))  # raw: 100 MiB/s
    m.record("l", "write", sample_of(64 * MiB, 0.5, 2.0, coded=True))  # no codec named: 32 MiB/s
    assert m.bandwidth("l", "write", coded=True) == 32 * MiB
    assert m.bandwidth("l", "write", coded=True, codec="blosc2") == 32 * MiB  # nothing per codec yet: all of them
    m.record("l", "write", sample_of(60 * MiB, 0.5, 1.0, coded=True, codec="blosc2"))  # 60 MiB/s end to end
    assert m.bandwidth("l", "write", coded=True, codec="blosc2") == 60 * MiB
    assert m.bandwidth("l", "write", coded=True, codec="blosc2-lz4") == 100 * MiB  # untried: the link's own
    assert m.bandwidth("l", "write", coded=True) == 46 * MiB  # all codecs: the median of 32 and 60
    for _ in range(3):
        m.record("l", "write", sample_of(90 * MiB, 0.8, 1.0, coded=True, codec="blosc2-lz4"))
    assert m.bandwidth("l", "write", coded=True, codec="blosc2-lz4") == 90 * MiB
    assert m.bandwidth("l", "write", coded=True, codec="blosc2") == 60 * MiB
    # reads with no figure of their own take the writes' (per codec as well)
    assert m.bandwidth("l", "read", coded=True, codec="blosc2") == 60 * MiB
    store = _Store(config={"endpoint": "http://127.0.0.1:2"})
    measured.record(store, "write", sample_of(64 * MiB, 0.5, 1.0, coded=True, codec="planes"))
    assert bandwidth_of(store, "write", coded=True, codec="planes") == 64 * MiB
    store.bandwidth = 2e9
    assert bandwidth_of(store, "write", coded=True, codec="planes") == 2e9  # a declared figure wins
