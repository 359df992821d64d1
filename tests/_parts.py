"""Test helper: read a checkpoint's binary index parts by hand, independently of cairn's reader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def delta_kinds(step: Path) -> list[int]:
    """The kind byte of every delta block of a checkpoint (its header's second byte, FORMAT.md §6.5: 0 XOR,
    1 sparse), in the order of the parts' records, read from the parts' columns and the own data files."""
    from cairn._format.partfile import (
        HEADER_BYTES,
        OWN,
        PART_VERSION_BLOCKS,
        RECORD,
        RECORD_BYTES,
        block_columns,
    )

    kinds: list[int] = []
    for index in Path(step).glob("*/index.*.json"):
        meta = json.loads(index.read_bytes())
        for part in meta.get("parts", []):
            data = (index.parent / part["name"]).read_bytes()
            n, m = part["records"], part["crcs"]
            rec = np.frombuffer(data, dtype=RECORD, count=n, offset=HEADER_BYTES)
            sizes = np.frombuffer(data, dtype="<u4", count=m, offset=HEADER_BYTES + n * RECORD_BYTES + 4 * m)
            src = block_columns(data, PART_VERSION_BLOCKS)[1]
            ends = [*rec["crc_start"][1:].tolist(), m]
            for r, end in zip(rec, ends):
                own = (index.parent / meta["files"][part["file_base"] + int(r["file"])]["name"]).read_bytes()
                pos = int(r["offset"])
                for b in range(int(r["crc_start"]), int(end)):
                    if src["file"][b] == OWN or src["codec"][b] == 3:
                        if src["codec"][b] == 3:
                            kinds.append(own[pos + 1])
                        pos += int(sizes[b])
    return kinds


def count_data_writes(monkeypatch) -> list[int]:
    """Record the size of every buffer a save hands a local data file (``*.bin``), in order, by wrapping
    `LocalStorage.write` for the test (`monkeypatch`): how many write calls its bytes took."""
    from cairn._storage import local as _local

    parts: list[int] = []
    real = _local.LocalStorage.write

    def write(self, key, it):
        def counted():
            for p in it:
                if key.endswith(".bin"):
                    parts.append(memoryview(p).nbytes)
                yield p
        return real(self, key, counted())

    monkeypatch.setattr(_local.LocalStorage, "write", write)
    return parts
