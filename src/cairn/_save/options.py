"""The options of one save, carried as one frozen value: `LoadOptions`' twin.

`cairn.save`, `cairn.save_async`, `CheckpointManager` and `cairn.copy` (when it
recompresses) take the same keywords; inside, they travel as one
`SaveOptions`, so that a new option is declared, checked and documented in
one place. The options are checked when they are made, before the path is
resolved or anything is written; what depends on the state or the
destination (the metadata's JSON, the block size, whether the checkpoint
exists) is checked by the engine, which knows the path to name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .._format import codecs as _codecs

#: The values of `compression` (see `cairn.save`; `engine.resolve_compression` says what each means).
COMPRESSIONS: tuple[str | bool | None, ...] = ("auto", True, "fast", False, None, "none", "zstd", "planes",
                                                "blosc2", "blosc2-lz4")
#: The modes that choose a codec per leaf (`engine.resolve_compression`): "fast" is "choose" with the
#: C-Blosc2 codecs among the candidates, which every reader then needs (the `fast` extra).
CHOOSING = ("choose", "auto", "fast")


def bad_compression(value: Any) -> ValueError:
    """The error for a `compression` that is none of `COMPRESSIONS`, naming them all."""
    names = [repr(c) for c in COMPRESSIONS if c is not None]
    return ValueError(f"compression must be {', '.join(names[:-1])} or {names[-1]}, not {value!r}")


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


@dataclass(frozen=True)
class SaveOptions:
    """What a save may be asked (see `cairn.save` and `cairn.save_async` for each option's meaning)."""

    overwrite: bool = False  # replace a checkpoint committed at the path
    coordinator: Any = None  # a `Coordinator`; None: JAX's, or a single process
    threads: int = 4  # writer threads (and at most as many data files) per process
    split_replicas: bool = False  # replicated arrays: each replica writes a share, not the first one all
    timeout: float = 1800.0  # each wait for the other processes, seconds
    snapshot_budget_bytes: int | None = None  # save_async: host bytes of the snapshot; None: no limit
    compression: str | bool | None = "auto"  # "auto", True, "fast", False/None/"none", or a codec (`COMPRESSIONS`)

    def __post_init__(self) -> None:
        for name in ("overwrite", "split_replicas"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not _positive_int(self.threads):
            raise ValueError(f"threads must be a positive integer, got {self.threads!r}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"timeout must be positive (seconds), got {self.timeout!r}")
        budget = self.snapshot_budget_bytes
        if budget is not None and not (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0):
            raise ValueError(f"snapshot_budget_bytes must be None or a non-negative integer, got {budget!r}")
        if not any(self.compression is c or (isinstance(c, str) and self.compression == c) for c in COMPRESSIONS):
            raise bad_compression(self.compression)

    def replace(self, **changes: Any) -> SaveOptions:
        """These options with `changes` (keyword names as in `cairn.save_async`); unknown names are a TypeError."""
        return dataclasses.replace(self, **changes) if changes else self


def save_options_of(options: SaveOptions | None, changes: dict[str, Any]) -> SaveOptions:
    """`options` (default: the defaults) with keyword `changes` applied."""
    return (options or _DEFAULT).replace(**changes)


_DEFAULT = SaveOptions()


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
    A pure function of the core count, so a test injects it (`engine._cores`)."""
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
