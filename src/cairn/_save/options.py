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
COMPRESSIONS: tuple[str | bool | None, ...] = ("auto", True, False, None, "none", "zstd", "planes", "blosc2")


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
    compression: str | bool | None = "auto"  # "auto", True, False/None/"none", "zstd", "planes" or "blosc2"

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
            raise ValueError("compression must be 'auto', True, False, 'none', 'zstd', 'planes' or 'blosc2', "
                             f"not {self.compression!r}")

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

    def on(self, cores: int) -> tuple[float, float]:
        """(encode, decode) bytes/s on `cores` cores."""
        n = max(1, cores) - 1
        return self.encode * (1 + self.encode_scale * n), self.decode * (1 + self.decode_scale * n)


_GiB = float(1 << 30)
#: Per-platform codec speeds, measured on the bf16-f32 trained state (1 MiB blocks) on the TPU v5e
#: host's 13 AMD cores: planes 0.54-0.61 / 0.87-0.99 GiB/s on one thread, 2.48-2.72 / 1.79-1.80 on 12
#: (docs/bench/tpu-v5e-host-codecs-after.json, -codec-threads-after.json); zstd level 1 0.53-0.57
#: GiB/s compress on one, 4.43 on 12 (-codec-candidates-256mb.json), decompress 0.82-0.87 on one and
#: 4.7-7.2 on 12 (issue 38's table); this project's 2-core VM, idle, 0.8-1.4 / 1.1-2.2 GiB/s per
#: core by leaf kind. Fixed figures, not a measurement at save time: what "auto" decides must not
#: depend on the machine's load at that moment (every process must agree, and a save is repeated
#: many times).
CODEC_SPEEDS = {
    "planes": CodecSpeed(encode=0.65 * _GiB, decode=0.9 * _GiB, encode_scale=0.31, decode_scale=0.1),
    "zstd": CodecSpeed(encode=0.55 * _GiB, decode=0.85 * _GiB, encode_scale=0.6, decode_scale=0.5),
}

# The optional "blosc2" codec (issue 38), priced only where python-blosc2 is importable, so that without it
# "auto" decides exactly as before. The same state on the TPU host: 0.51 / 1.55 GiB/s on one thread,
# 3.31 / 7.68 on 12 (docs/bench/tpu-v5e-host-native-codecs.json).
if _codecs.blosc2_available():
    CODEC_SPEEDS["blosc2"] = CodecSpeed(encode=0.5 * _GiB, decode=1.5 * _GiB, encode_scale=0.5, decode_scale=0.36)


def predicted_seconds(raw: float, stored: float, codec: str, bandwidth: float, cores: int) -> tuple[float, float]:
    """(raw, coded): predicted seconds to save `raw` bytes and load them back, stored raw or coded by
    `codec` into `stored` bytes, over a storage of `bandwidth` bytes/s, coding on `cores` cores. The
    codec works while the bytes move (a save codes the next blocks while it writes the last; a load
    decodes each read as it lands), so each direction takes the longer of the transfer and the codec:
    ``max(stored / bandwidth, raw / encode) + max(stored / bandwidth, raw / decode)``, against
    ``2 * raw / bandwidth``."""
    enc, dec = CODEC_SPEEDS[codec].on(cores)
    move = stored / bandwidth
    return 2 * raw / bandwidth, max(move, raw / enc) + max(move, raw / dec)


def compression_pays(raw: float, stored: float, codec: str, bandwidth: float, cores: int) -> bool:
    """Whether storing `raw` bytes as `stored` coded bytes saves at least AUTO_MIN_GAIN of the
    predicted time of a save and a load (`predicted_seconds`)."""
    if codec == "none" or raw <= 0:
        return False
    plain, coded = predicted_seconds(raw, stored, codec, bandwidth, cores)
    return coded <= (1 - AUTO_MIN_GAIN) * plain


def compression_can_pay(bandwidth: float, cores: int) -> bool:
    """Whether any leaf could be worth coding on this storage: even a leaf that codes to nothing
    takes ``raw / encode + raw / decode``. Where that is no faster than the raw transfer (a local
    disk, whose bandwidth beats the codecs), "auto" stores every block raw (format version 2)."""
    return any(compression_pays(1.0, 0.0, codec, bandwidth, cores) for codec in CODEC_SPEEDS)
