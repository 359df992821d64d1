"""Test helper: rewrite a committed checkpoint's indexes in format version 1 (every chunk explicit).

Hostile-input tests forge an index's JSON chunk table; a version-2 index keeps
most chunks in binary parts, so those tests first turn the checkpoint into the
version-1 form it still reads (the binary-part forgeries have tests of their own).
"""

from __future__ import annotations

import json

from cairn._format import manifest as fmt
from cairn._load.source import open_checkpoint


def as_version_1(path) -> None:
    opened = open_checkpoint(path)
    for name, info in opened.manifest.items.items():
        index = opened.indexes[name]
        if index.table is not None:
            index.table.fetch_all()
        (path / info.dir / info.index).write_bytes(index.to_json(version=1))
    m = json.loads((path / fmt.MANIFEST).read_bytes())
    m.pop("crc32c")
    m["version"] = 1
    (path / fmt.MANIFEST).write_bytes(fmt.dump_checked_json(m))


def as_explicit(path) -> None:
    """Rewrite a checkpoint's indexes with every chunk in the JSON (its version kept: version 3 keeps
    its codecs, and each compressed chunk's block sizes go into the JSON ``stored`` list)."""
    opened = open_checkpoint(path)
    for name, info in opened.manifest.items.items():
        index = opened.indexes[name]
        if index.table is not None:
            index.table.fetch_all()
        (path / info.dir / info.index).write_bytes(index.to_json(version=index.version, explicit=True))
