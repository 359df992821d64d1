"""The codec policy of a save, in one place: what `compression=` means (`resolve_compression`), what
"auto" prices a leaf with (`auto_prices`, and the per-platform codec speeds and the predicted-time
formulas: `CODEC_SPEEDS`, `predicted_seconds`, `compression_pays`), each leaf's codec from a sample
of its first chunk (`decide_leaf`, `leaf_codec`; a streamed leaf's from its first slab,
`stream_codec`), and measuring the leaves a save writes, alike on every process (`choose_codecs`,
`_Choosing`, which measures small leaves in groups). The block coding itself is `_codecs.codecs`'.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._codecs import choose as _choose
from .._codecs import codecs as _codecs
from .._core.host import usable_cores
from .._dist.coord import fetch_from
from .._storage.base import bandwidth_of, bandwidth_source
from .assign import UNCHANGED, Concat, SaveItem, files_in_turn
from .options import CHOOSING, bad_compression


def coder_cores() -> int:
    """The cores this process may run on: a compressed save codes on all of them (the writer threads,
    `threads`, bound how many files are written at once, not how many cores code)."""
    return usable_cores()


# ------------------------------------------------------------------ compression="auto": does it pay?

#: Compression must save at least this fraction of the predicted time (a save and a load) to be used.
AUTO_MIN_GAIN = 0.05


@dataclass(frozen=True)
class CodecSpeed:
    """A codec's speed on this platform, in bytes of raw data per second: one core's, and how many
    cores' worth n threads give (``1 + scale * (n - 1)``)."""

    encode: float
    decode: float
    encode_scale: float
    decode_scale: float

    def on(self, cores: float) -> tuple[float, float]:
        """(encode, decode) bytes/s on `cores` cores (a fraction: cores busy on average)."""
        n = max(1, cores) - 1
        return self.encode * (1 + self.encode_scale * n), self.decode * (1 + self.decode_scale * n)


_GiB = float(1 << 30)
#: Per-platform codec speeds, measured on the bf16-f32 trained state (1 MiB blocks) on the TPU v5e
#: host's 13 AMD cores: planes 0.54-0.61 / 0.87-0.99 GiB/s on one thread, 2.48-2.72 / 1.79-1.80 on 12
#: (benchmarks/results/tpu-v5e-host-codecs-after.json, -codec-threads-after.json); zstd level 1 0.53-0.57
#: GiB/s compress on one, 4.43 on 12 (-codec-candidates-256mb.json), decompress 0.82-0.87 on one and
#: 4.7-7.2 on 12; this project's 2-core VM, idle, 0.8-1.4 / 1.1-2.2 GiB/s per
#: core by leaf kind. An idle host's figures: what earlier saves of this process measured scales them
#: (`CodecMeter`, the codec factor), and the primary's factor holds for every process.
CODEC_SPEEDS = {
    "planes": CodecSpeed(encode=0.65 * _GiB, decode=0.9 * _GiB, encode_scale=0.31, decode_scale=0.1),
    "zstd": CodecSpeed(encode=0.55 * _GiB, decode=0.85 * _GiB, encode_scale=0.6, decode_scale=0.5),
}

# The optional C-Blosc2 codecs ("fast" and the named codecs), priced only where python-blosc2 is
# importable. The same state on the TPU host: 0.51 / 1.55 GiB/s on one thread,
# 3.31 / 7.68 on 12 (benchmarks/results/tpu-v5e-host-native-codecs.json).
if _codecs.blosc2_available():
    CODEC_SPEEDS["blosc2"] = CodecSpeed(encode=0.5 * _GiB, decode=1.5 * _GiB, encode_scale=0.5, decode_scale=0.36)
    # "blosc2-lz4" (bit shuffle and LZ4), C-Blosc2 called directly, the same state on the TPU host: 1.32 / 2.28
    # GiB/s on one thread, 7.27 / 6.75 on 12 (benchmarks/results/tpu-v5e-lz4-codecs.json); this project's VM 1.59 /
    # 2.00 on one, 3.02 / 3.41 on two. By these figures it does not pay on a local disk (8 GiB/s) on 13 cores.
    CODEC_SPEEDS["blosc2-lz4"] = CodecSpeed(encode=1.3 * _GiB, decode=2.3 * _GiB, encode_scale=0.41,
                                            decode_scale=0.18)


#: One core's speed of a codec on leaves of one element size, where it differs from the whole state's
#: (`CODEC_SPEEDS`, whose scaling over cores these keep), measured on this project's 2-core VM with
#: ``python -m benchmarks.probe native_codecs --dtype bfloat16`` / ``--dtype float32``:
#: C-Blosc2 runs zstd over every byte plane, and a bf16 block's near-random
#: mantissa plane is half of it, where `planes` stores that plane raw after a probe: "blosc2" compresses
#: bf16 at half `planes`' speed on one core (0.33 against 0.69 GiB/s; f32 0.45 against 0.41) and both
#: decode bf16 at 1.1 GiB/s (f32: 1.2-1.4 against 0.9).
CODEC_SPEEDS_BY_SIZE: dict[tuple[str, int], tuple[float, float]] = {
    ("planes", 2): (0.69 * _GiB, 1.1 * _GiB), ("blosc2", 2): (0.33 * _GiB, 1.1 * _GiB),
    ("planes", 4): (0.41 * _GiB, 0.92 * _GiB), ("blosc2", 4): (0.45 * _GiB, 1.3 * _GiB),
}


def codec_speed(codec: str, itemsize: int) -> CodecSpeed:
    """`codec`'s speed on leaves of `itemsize`-byte elements: `CODEC_SPEEDS_BY_SIZE`'s one-core figures
    where it has them, with `CODEC_SPEEDS`' scaling over cores; else `CODEC_SPEEDS`' own."""
    whole = CODEC_SPEEDS[codec]
    one = CODEC_SPEEDS_BY_SIZE.get((codec, itemsize))
    return whole if one is None else dataclasses.replace(whole, encode=one[0], decode=one[1])


def blosc2_faster(cores: int, itemsize: int) -> bool:
    """Whether "blosc2" codes leaves of `itemsize`-byte elements faster than "planes" on `cores` cores:
    a save's encoding and a load's decoding, ``raw / encode + raw / decode`` at each codec's
    `codec_speed` on that many cores. False where python-blosc2 is not importable. By these figures
    "blosc2" wins for f32 leaves on any host and for bf16 ones from 8 cores on: on a few cores
    (this project's 2-core VM) `planes`' raw mantissa planes save more time than Blosc2's C saves.
    A pure function of the core count, so a test injects it (`coder_cores`)."""
    if "blosc2" not in CODEC_SPEEDS:
        return False

    def seconds(codec: str) -> float:
        enc, dec = codec_speed(codec, itemsize).on(cores)
        return 1 / enc + 1 / dec

    return seconds("blosc2") < seconds("planes")


#: A coded save's coding (raw bytes) under this is too little to measure the codecs' speed by.
MIN_CODED_SAMPLE = 8 << 20
#: The codec factor stays within these bounds (a measurement outside them is a glitch, not a host).
FACTOR_RANGE = (0.02, 2.0)


class CodecMeter:
    """How fast the codecs really ran on this host, as a share of `CODEC_SPEEDS` (the "codec factor").

    A compressed save reports each coding task's span and what it coded (`task`); at its end
    (`finish`) the factor of that save is the time the per-platform figures predict for its
    coding, at the concurrency the tasks really had, over the time the coder pool was busy (the
    union of the tasks' spans): 1 where the host codes as fast as the figures say, 0.3 where other
    work left the codecs a third of it. The host's factor (`factor`) is the median of the last
    `KEEP` saves' factors, 1.0 before any. Decoding is assumed to run at the same share: a load's
    decoding is not measured."""

    KEEP = 5

    def __init__(self) -> None:
        import threading
        from collections import deque

        self._lock = threading.Lock()
        self._factors: deque[float] = deque(maxlen=self.KEEP)

    def record(self, spans: list[tuple[float, float]], coded: dict[str, int], cores: int) -> float | None:
        """Add the factor of one save that coded `coded` raw bytes per codec in tasks spanning
        `spans` (start, end) on at most `cores` cores; returns it, or None if too little was coded."""
        from .._storage.measured import union_seconds

        raw = sum(coded.values())
        busy = union_seconds(spans)
        if raw < MIN_CODED_SAMPLE or busy <= 0:
            return None
        concurrency = min(max(1.0, sum(b - a for a, b in spans) / busy), float(max(1, cores)))
        predicted = sum(n / CODEC_SPEEDS[c].on(concurrency)[0] for c, n in coded.items() if c in CODEC_SPEEDS)
        if predicted <= 0:
            return None
        f = min(max(predicted / busy, FACTOR_RANGE[0]), FACTOR_RANGE[1])
        with self._lock:
            self._factors.append(f)
        return f

    def factor(self) -> float:
        """The median of the last saves' factors; 1.0 (the per-platform figures) before any."""
        import statistics

        with self._lock:
            return statistics.median(self._factors) if self._factors else 1.0

    def clear(self) -> None:
        with self._lock:
            self._factors.clear()


#: This process's codec factor (`CodecMeter`).
CODEC_METER = CodecMeter()


def predicted_seconds(raw: float, stored: float, codec: str, bandwidth: float, cores: int,
                      read_bandwidth: float | None = None, factor: float = 1.0,
                      coded_bandwidth: float | None = None,
                      coded_read_bandwidth: float | None = None) -> tuple[float, float]:
    """(raw, coded): predicted seconds to save `raw` bytes and load them back, stored raw or coded by
    `codec` into `stored` bytes, coding on `cores` cores at `factor` of the per-platform speed
    (`CODEC_SPEEDS`; `CodecMeter` measures it). Raw transfers write at `bandwidth` bytes/s and read
    at `read_bandwidth` (default: the same); coded ones at `coded_bandwidth` and
    `coded_read_bandwidth` (default: the raw figures; measured, they are what coded transfers reached
    end to end, `_storage.measured`). The codec works while the bytes move (a save codes the next
    blocks while it writes the last; a load decodes each read as it lands), so each direction takes
    the longer of the transfer and the codec:
    ``max(stored / coded write, raw / encode) + max(stored / coded read, raw / decode)``, against
    ``raw / write + raw / read``."""
    enc, dec = CODEC_SPEEDS[codec].on(cores)
    enc, dec = enc * factor, dec * factor
    read = bandwidth if read_bandwidth is None else read_bandwidth
    cw = bandwidth if coded_bandwidth is None else coded_bandwidth
    cr = read if coded_read_bandwidth is None else coded_read_bandwidth
    return raw / bandwidth + raw / read, max(stored / cw, raw / enc) + max(stored / cr, raw / dec)


def compression_pays(raw: float, stored: float, codec: str, bandwidth: float, cores: int, **prices: Any) -> bool:
    """Whether storing `raw` bytes as `stored` coded bytes saves at least AUTO_MIN_GAIN of the
    predicted time of a save and a load (`predicted_seconds`, with the same arguments: `prices` are
    its optional ones)."""
    if codec == "none" or raw <= 0:
        return False
    plain, coded = predicted_seconds(raw, stored, codec, bandwidth, cores, **prices)
    return coded <= (1 - AUTO_MIN_GAIN) * plain


def compression_can_pay(bandwidth: float, cores: int, **prices: Any) -> bool:
    """Whether any leaf could be worth coding on this storage: even a leaf that codes to nothing
    takes ``raw / encode + raw / decode``. Where that is no faster than the raw transfer (a local
    disk, whose bandwidth beats the codecs), "auto" stores every block raw (format version 2)."""
    return any(compression_pays(1.0, 0.0, codec, bandwidth, cores, **prices) for codec in usable_codecs()
               if codec not in _codecs.BLOSC2_CODECS)  # "auto" picks only codecs every install reads


def usable_codecs() -> list[str]:
    """The priced codecs (`CODEC_SPEEDS`) a save may use now: the C-Blosc2 ones only while python-blosc2
    is importable (`codecs.blosc2_available`, which a test may switch off after import)."""
    return [c for c in CODEC_SPEEDS if c not in _codecs.BLOSC2_CODECS or _codecs.blosc2_available()]


def resolve_compression(compression: str | bool | None, storage: Any) -> str | None:
    """What a save's `compression=` means: None (blocks stored raw), "choose" (a codec per leaf),
    "auto" (a codec per leaf where it pays), "fast" ("choose" with the C-Blosc2 codecs among the
    candidates: `decide_leaf`), or one codec.

    "auto" (the default) decides by predicted time (`compression_pays`): the codecs'
    speed on this platform's cores (scaled by what earlier saves measured, `CodecMeter`)
    against the storage's bandwidth each way (declared, measured on earlier transfers, or its
    kind's default: `_storage.base.bandwidth_of`). Where no leaf could pay, not even one
    that codes to nothing (`compression_can_pay`: a local disk, faster than the codecs),
    None; else "auto", and each leaf is coded only if its sample's ratio pays
    (`leaf_codec`). True chooses per leaf by size alone; both pick only "zstd" and "planes", which
    every install reads. "fast" and the C-Blosc2 codecs need python-blosc2 (a ValueError naming the
    extra where it is missing). False, None and "none" store raw bytes.
    In a save, the primary's answer holds for every process.
    """
    if compression == "auto":
        p = auto_prices(storage)
        return "auto" if compression_can_pay(p["bandwidth"], coder_cores(), **formula_args(p)) else None
    if compression is True:
        return "choose"
    if compression == "fast":
        if not _codecs.blosc2_available():
            raise ValueError(f"compression='fast' needs python-blosc2, which is not installed: "
                             f"pip install '{_codecs.BLOSC2_EXTRA}'")
        return "fast"
    if compression in (False, None, "none"):
        return None
    if compression in ("zstd", "planes"):
        return str(compression)
    if compression in _codecs.BLOSC2_CODECS:
        if not _codecs.blosc2_available():
            raise ValueError(f"compression={compression!r} needs python-blosc2, which is not installed: "
                             f"pip install '{_codecs.BLOSC2_EXTRA}'")
        return str(compression)
    raise bad_compression(compression)


#: The codec "auto" weighs against the leaf's codec by predicted time: it stores more and codes faster.
FAST_CODEC = "blosc2-lz4"


@dataclass(frozen=True)
class LeafDecision:
    """What `compression=` decides for one leaf, from a sample of its bytes, and why."""

    codec: str  # what the leaf is stored with ("none": raw)
    chosen: str  # `choose.choose_sized`'s codec for the sample ("none": no codec shrinks it enough)
    raw: int  # the sample's raw bytes
    stored: int  # their size under `chosen`


def decide_leaf(mode: str, dtype: Any, host: Any, bandwidth: float, prices: dict[str, Any] | None = None,
                cores: int | None = None) -> LeafDecision:
    """`leaf_codec`'s decision with its reasons; `cores` (default: this process's) as "auto" counts them.
    The codec is chosen on `sample_bytes` of `host`, with "blosc2" a candidate only where it codes the
    leaf's element size faster than "planes" on those cores (`blosc2_faster`); "auto" then
    takes `FAST_CODEC` instead where `predicted_seconds` says it saves and loads the leaf
    sooner, and codes the leaf only where that pays (`compression_pays`)."""
    n = cores or coder_cores()
    c_blosc2 = mode == "fast"  # True and "auto" pick only codecs every install reads (no C-Blosc2)
    try:
        sample = _choose.sample(host, sample_bytes(getattr(host, "nbytes", 0)))
        # "blosc2" is a candidate only where it codes this leaf's elements faster on n cores
        codec, raw, stored = _choose.choose_sized(dtype, sample,
                                                  blosc2=c_blosc2 and blosc2_faster(n, np.dtype(dtype).itemsize))
        args = formula_args(prices or {}, codec)
        if c_blosc2 and codec != "none" and FAST_CODEC in usable_codecs():
            # the faster C-Blosc2 codec, where it is predicted to save and load the leaf sooner, its
            # 3-10% more bytes and all (a fast link, many cores), each priced with its own coded figures
            fast, fast_args = _choose.stored_size(FAST_CODEC, dtype, sample), formula_args(prices or {}, FAST_CODEC)
            if (predicted_seconds(raw, fast, FAST_CODEC, bandwidth, n, **fast_args)[1]
                    < predicted_seconds(raw, stored, codec, bandwidth, n, **args)[1]):
                codec, stored, args = FAST_CODEC, fast, fast_args
    except ValueError:  # a dtype no codec knows
        return LeafDecision("none", "none", 0, 0)
    if mode == "auto" and not compression_pays(raw, stored, codec, bandwidth, n, **args):
        return LeafDecision("none", codec, raw, stored)
    return LeafDecision(codec, codec, raw, stored)


#: A leaf's sample is at most 1 / SAMPLE_SHARE of its first chunk (`sample_bytes`), so that choosing
#: codes a fraction of a state of small leaves, not all of it three times over (a leaf under
#: `choose.SAMPLE_BYTES` was sampled whole: 2,449 leaves of 256x256 spent more time choosing than
#: coding).
SAMPLE_SHARE = 4
#: ... and at least this many bytes (or the whole chunk, if smaller).
SAMPLE_MIN_BYTES = 16 << 10


def sample_bytes(nbytes: int) -> int:
    """How many bytes of a leaf's first chunk of `nbytes` bytes its codec is chosen on."""
    return min(_choose.SAMPLE_BYTES, max(SAMPLE_MIN_BYTES, nbytes // SAMPLE_SHARE))


def formula_args(prices: dict[str, Any], codec: str | None = None) -> dict[str, Any]:
    """`auto_prices`' figures as `predicted_seconds`' optional arguments (the codec factor:
    this host's measured one where `prices` has none), with `codec`'s own coded figures where it has
    them."""
    f = prices.get("codec_factor")
    own = (prices.get("coded_by_codec") or {}).get(codec) if codec is not None else None
    cw, cr = own if own else (prices.get("coded_bandwidth"), prices.get("coded_read_bandwidth"))
    return {"read_bandwidth": prices.get("read_bandwidth") or None,
            "coded_bandwidth": cw or None, "coded_read_bandwidth": cr or None,
            "factor": CODEC_METER.factor() if f is None else f}


def leaf_codec(mode: str, dtype: Any, host: Any, bandwidth: float, prices: dict[str, Any] | None = None) -> str:
    """The codec of a leaf under `mode` ("choose", "auto" or "fast", as `resolve_compression` gives), measured
    on a sample of `host` (its first chunk's host bytes): `choose.choose`'s codec, which "auto" keeps
    only where its sample's ratio pays writing raw at `bandwidth` bytes/s, against the rest of
    `prices` (`auto_prices`: reads, coded transfers, the codec factor; by default the same bandwidth
    each way and this host's measured codec factor): `compression_pays`. (`decide_leaf`
    gives the reasons too.)"""
    return decide_leaf(mode, dtype, host, bandwidth, prices).codec


def describe_compression(mode: str | None, storage: Any, codecs: dict[str, dict[int, str]],
                         prices: dict[str, Any]) -> str:
    """One line for `SaveStats.compression`: the setting, what it priced (`describe_prices`), the
    leaves' codecs. E.g. ``auto (object storage at 0.50 GiB/s (default), 13 cores): 1 none, 120 planes``."""
    if mode is None:
        return "raw"
    counts: dict[str, int] = {}
    for per_item in codecs.values():
        for c in per_item.values():
            counts[c] = counts.get(c, 0) + 1
    leaves = ", ".join(f"{n} {c}" for c, n in sorted(counts.items()))
    if mode != "auto":
        return f"{mode}: {leaves}"
    return f"auto ({describe_prices(storage.kind, prices, coder_cores())}): {leaves}"


def describe_prices(kind: str, prices: dict[str, Any], cores: int) -> str:
    """What "auto" priced, in words: ``object storage at 0.50 GiB/s (default), 13 cores``, or
    ``object storage at 0.14 GiB/s write, 0.74 read, coded 0.09 / 0.31 (measured), 2 cores, codecs
    at 0.74x`` (raw writes and reads; coded ones, end to end; the codec factor)."""
    gib = float(1 << 30)
    w = prices["bandwidth"]
    r = prices.get("read_bandwidth") or w
    cw = prices.get("coded_bandwidth") or w
    cr = prices.get("coded_read_bandwidth") or r
    text = f"{kind} storage at {w / gib:.2f} GiB/s"
    if abs(r - w) > 0.005 * gib:
        text += f" write, {r / gib:.2f} read"
    if abs(cw - w) > 0.005 * gib or abs(cr - r) > 0.005 * gib:
        text += f", coded {cw / gib:.2f} / {cr / gib:.2f}"
    source = prices.get("bandwidth_source")
    text += f" ({source})" if source else ""
    text += f", {cores} cores"
    factor = prices.get("codec_factor", 1.0)
    if abs(factor - 1.0) > 0.005:
        text += f", codecs at {factor:.2f}x"
    return text


def choose_codecs(job: Any, background: bool = False) -> tuple[dict[str, dict[int, str]], _Choosing | None]:
    """The codec of each array leaf this process writes a chunk of, alike on every process.

    A fixed codec applies to every leaf. With "choose", the writer of a leaf's
    first cell measures `choose.choose` on a sample of that chunk's host bytes;
    with several processes, the others learn its choice through the coordinator
    (a background step, with the save's timeout), before any of them writes.

    With `background` and a single process, the leaves are measured on a pool of their own in the
    order of the files that hold them, and a `_Choosing` is returned with the (still filling)
    codecs: a file's writer waits only for its own leaves (`_Choosing.wait`), so the first files
    are coded and written while later leaves are still measured (and, from a device, copied to
    host). Else (None) every codec is known on return.
    """
    from .._tree.leaves import ArraySource

    coord, me = job.coord, job.coord.process_index
    fixed = job.compression
    assert fixed is not None, "leaf codecs are chosen only for a compressed save"
    out: dict[str, dict[int, str]] = {}
    need: dict[int, list[tuple[str, int]]] = {}  # owner -> (item, leaf) this process writes and does not own
    todo: list[tuple[dict[int, str], int, Any, Any, SaveItem]] = []  # leaves this process measures
    for item in job.items:
        mine = out[item.name] = {}
        written = {leaf for leaf, _cell in item.sources}
        for i, layout in item.layouts.items():
            src = item.leaves[i]
            if not isinstance(src, ArraySource):
                continue
            owner = layout.writer[0]
            if fixed not in CHOOSING:
                mine[i] = fixed if i in written or owner == me else "none"
            elif owner == me:
                first = item.sources.get((i, 0))
                if first is not None and first is not UNCHANGED:  # (never read by an async incremental save)
                    mine[i] = "none"
                    todo.append((mine, i, first, src.dtype, item))
                else:
                    mine[i] = "none"
            elif i in written:
                need.setdefault(owner, []).append((item.name, i))
    # (No kept host copies where a save_async's snapshot budget left chunks on device: its writers bring
    # them to host one at a time, and host memory must stay within that budget.)
    keep = 0 if job.stats.device_copy_bytes else keep_host_bytes()
    if todo:  # each owned leaf measured on a sample, on every core (a state may have thousands)
        choosing = _Choosing(job, todo, keep)
        if background and coord.process_count == 1:
            return out, choosing
        choosing.close()  # every codec known before any file is written
    if job.compression in CHOOSING and coord.process_count > 1:
        base = f"cairn/save/{job.seq}/codecs"
        coord.publish(f"{base}/{me}", json.dumps({name: {str(i): c for i, c in m.items()}
                                                  for name, m in out.items()}).encode())
        for owner, wanted in need.items():
            theirs = json.loads(fetch_from(coord, f"{base}/{owner}", job.timeout, writer=owner))
            for name, i in wanted:
                out[name][i] = theirs.get(name, {}).get(str(i), "none")
    return out, None


class _Choosing:
    """The codecs of this process's leaves, measured on a pool of their own (`close` waits for all; with
    `choose_codecs`' `background`, a single process's files are written meanwhile): leaves in the order
    of the first file holding them, each leaf released to its writers (`wait`) once it has its codec.
    Small leaves are measured in groups (`_groups`): one decision for a run of leaves alike. A
    failure is raised to every writer waiting. The host copy a leaf was measured on replaces its
    device chunk among the save's sources within `keep` bytes (as `choose_codecs` does), before the
    leaf is released, so its writer never copies that chunk again; where the save's host-copy
    pipeline (`SaveJob._pipe`) had started that chunk's transfer, the leaf is measured on it and
    the writer takes the same transfer."""

    def __init__(self, job: Any, todo: list[tuple[dict[int, str], int, Any, Any, SaveItem]], keep: int):
        self._job, self._keep = job, keep
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._ready = {(t[4].name, t[1]): threading.Event() for t in todo}
        first_file: dict[tuple[str, int], int] = {}  # (item, leaf) -> rank of the first file holding a chunk
        ranked = files_in_turn(job.items)
        for rank, (item, k) in enumerate(ranked):
            for s in item.files[k]:
                first_file.setdefault((item.name, s.leaf), rank)
        todo = sorted(todo, key=lambda t: first_file.get((t[4].name, t[1]), len(ranked)))
        groups = _groups(todo)
        self._pool = ThreadPoolExecutor(min(coder_cores(), len(groups)), thread_name_prefix="cairn-choose")
        self._futures = [self._pool.submit(self._measure, g) for g in groups]

    def _measure(self, group: list[tuple[dict[int, str], int, Any, Any, SaveItem]]) -> None:
        if self._error is not None:
            return
        job, pipe = self._job, self._job._pipe
        try:
            # The members sampled (all of a group of one); a started transfer where the pipeline has one.
            picks = _picked(len(group))
            firsts, peeked = [], []
            for n in picks:
                _, i, first, _, item = group[n]
                got = pipe.peek((item.name, (i, 0))) if pipe is not None and (item.name, (i, 0)) in pipe else None
                firsts.append(first if got is None else got)
                peeked.append(got is not None)
            dtype = group[0][3]
            if len(group) == 1:
                codec, host = _choose_leaf(job, firsts[0], dtype)
                hosts = [host]
            else:
                codec, hosts = _choose_group(job, firsts, dtype)
        except BaseException as e:  # every waiting writer raises it
            with self._lock:
                self._error = self._error or e
                for ev in self._ready.values():
                    ev.set()
            return
        with self._lock:
            for mine, i, _, _, _ in group:
                mine[i] = codec
            # The host copy a sample was taken from (a device chunk's, made for this) serves the writer
            # too: a device chunk is not copied to host twice (held within `keep` bytes until written).
            for n, host, was_peeked in zip(picks, hosts, peeked):
                _, i, _, _, item = group[n]
                if host is not None and not was_peeked and host.nbytes <= self._keep:
                    item.sources[(i, 0)] = host
                    self._keep -= host.nbytes
            for _, i, _, _, item in group:
                self._ready[(item.name, i)].set()

    def ready(self, item: str, leaf: int) -> bool:
        """Whether leaf `leaf` of `item` has its codec (or measuring failed: `wait` raises)."""
        ev = self._ready.get((item, leaf))
        return ev is None or ev.is_set()

    def wait(self, item: str, leaf: int) -> None:
        """Return once leaf `leaf` of `item` has its codec (at once for a leaf not measured here); raise
        what measuring raised."""
        ev = self._ready.get((item, leaf))
        if ev is not None:
            ev.wait()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Wait for the measuring pool (every leaf measured, or the save failed)."""
        self._pool.shutdown(wait=True)
        if self._error is not None:
            raise self._error


#: Small leaves are measured in groups (`_groups`): a run of consecutive leaves (in the order of the
#: files holding them, so mostly of one array, or one kind of leaf, of the pytree) whose first chunks
#: hold at most GROUP_MAX_BYTES, of one dtype and one size class (the same power of two), up to
#: GROUP_LEAVES of them. One decision serves the whole group, measured on GROUP_SAMPLES of its leaves
#: spread over it (`_choose_group`). Measured one by one, 2,449 leaves of 256x256 spent ~1.1 ms each on
#: the TPU host choosing (three encoders each, python-blosc2's fixed ~0.18 ms a call): more than coding
#: them. 1: every leaf measured on its own.
GROUP_MAX_BYTES = 1 << 20
GROUP_LEAVES = 64
GROUP_SAMPLES = 4


def _groups(todo: list[Any]) -> list[list[Any]]:
    """`todo` (`_Choosing`'s leaves, in order) cut into the groups measured together: runs of small leaves
    alike (`GROUP_MAX_BYTES`), each other leaf alone."""
    out: list[list[Any]] = []
    run_key: Any = None
    for t in todo:
        n = _first_bytes(t[2])
        key = (np.dtype(t[3]), n.bit_length()) if GROUP_LEAVES > 1 and 0 < n <= GROUP_MAX_BYTES else None
        if key is not None and key == run_key and len(out[-1]) < GROUP_LEAVES:
            out[-1].append(t)
        else:
            out.append([t])
        run_key = key
    return out


def _first_bytes(first: Any) -> int:
    try:
        return sum(int(p.nbytes) for p in first.parts) if type(first) is Concat else int(first.nbytes)
    except (AttributeError, TypeError):
        return 0


def _picked(n: int) -> list[int]:
    """Which of a group's `n` leaves are sampled: GROUP_SAMPLES of them spread evenly, first and last included."""
    m = min(n, max(1, GROUP_SAMPLES))
    return sorted({round(j * (n - 1) / max(1, m - 1)) for j in range(m)})


def _choose_group(job: Any, firsts: list[Any], dtype: Any) -> tuple[str, list[np.ndarray | None]]:
    """The codec of a group of small leaves (`_groups`), decided once as `_choose_leaf` decides one leaf's,
    on the first chunks `firsts` of its sampled leaves laid end to end (`decide_leaf` then samples that
    run in pieces spread over it, so over the sampled leaves); the host copies made, as `_choose_leaf`'s."""
    sampled = [_sample_host(job, first) for first in firsts]
    assert job.compression is not None
    prices = job.priced()
    joined = np.concatenate([np.ascontiguousarray(h).reshape(-1) for h, _ in sampled])
    return leaf_codec(job.compression, dtype, joined, prices["bandwidth"], prices), [made for _, made in sampled]


def _choose_leaf(job: Any, first: Any, dtype: Any) -> tuple[str, np.ndarray | None]:
    """The codec of a leaf whose first chunk is `first`, and that chunk's host copy where measuring
    made one (a device chunk's, which the writer can use instead of copying it again), else None."""
    host, made = _sample_host(job, first)
    assert job.compression is not None
    prices = job.priced()
    return leaf_codec(job.compression, dtype, host, prices["bandwidth"], prices), made


def _sample_host(job: Any, first: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """The host bytes a leaf whose first chunk is `first` is measured on (a merged chunk's first
    piece), and that host copy again where it is a fresh copy of the whole chunk from an accelerator
    (which the writer can use instead of copying the chunk again), else None."""
    whole = type(first) is not Concat
    part = first if whole else first.parts[0]
    host = job._host(part)
    return host, (host if whole and type(part) is not np.ndarray and fresh_copy(part) else None)


def fresh_copy(src: Any) -> bool:
    """Whether `SaveJob._host` of `src` copies it from an accelerator (not a view of host memory)."""
    from .._tree.shardings import on_cpu

    try:
        return not on_cpu(src) and getattr(src.sharding, "memory_kind", None) not in ("pinned_host", "unpinned_host")
    except AttributeError:
        return False


#: Host copies made while choosing codecs that a blocking save keeps for its writers: at most this
#: share of the host's physical memory (a save_async's snapshot holds its chunks on host already).
KEEP_HOST_SHARE = 0.25


def keep_host_bytes() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * KEEP_HOST_SHARE)
    except (ValueError, OSError, AttributeError):
        return 1 << 30


def auto_prices(storage: Any) -> dict[str, Any]:
    """What "auto" prices leaves with on this process, as `SaveJob`'s fields: the storage's
    bandwidth each way, where it came from, and the codec factor (`CodecMeter`)."""
    return {"bandwidth": bandwidth_of(storage), "read_bandwidth": bandwidth_of(storage, "read"),
            "coded_bandwidth": bandwidth_of(storage, "write", coded=True),
            "coded_read_bandwidth": bandwidth_of(storage, "read", coded=True),
            # each codec's own coded figures, write and read (`_storage.measured`: an end-to-end figure of
            # one codec says little of another's)
            "coded_by_codec": {c: [bandwidth_of(storage, "write", True, c), bandwidth_of(storage, "read", True, c)]
                               for c in CODEC_SPEEDS},
            "codec_factor": CODEC_METER.factor(), "bandwidth_source": bandwidth_source(storage)}


def stream_codec(compression: str | None, kind: str, dtype: np.dtype, first: np.ndarray, storage: Any) -> str:
    """A streamed leaf's codec (`stream.StreamWriter`), from the writer's `compression` (as
    `resolve_compression` gives) and, for "choose" and "auto", its first slab's bytes `first`."""
    if compression is None or kind != "array":
        return "none"
    if compression not in CHOOSING:
        return compression
    n = first.nbytes - first.nbytes % dtype.itemsize
    return leaf_codec(compression, dtype, first[:n].view(dtype), bandwidth_of(storage))
