"""Render docs/FORMAT.md §11 (the worked example) from the `step_5` golden's files.

    .venv/bin/python tests/golden/format_example.py

rewrites the section between "## 11. Worked example" and "## 12." so the
document shows exactly the bytes of tests/golden/v1/step_5 (token, sizes,
checksums); tests/format/test_golden.py checks that it does. Needs only json and numpy.
"""

# ruff: noqa: RUF001  (the prose keeps FORMAT.md's en dashes)
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

HERE = Path(__file__).resolve().parent
V1 = HERE / "v1"
FORMAT_MD = HERE.parent.parent / "docs" / "FORMAT.md"



def _item(k: str, v: object) -> str:
    return f"{json.dumps(k)}: {json.dumps(v)}"


def _items(d: dict) -> str:
    return ", ".join(_item(k, v) for k, v in d.items())


def _wrap(parts: list[str], indent: str, width: int = 92) -> list[str]:
    """Join `parts` with ", " into lines of at most `width` characters (after `indent`)."""
    lines = [parts[0]]
    for part in parts[1:]:
        if len(indent) + len(lines[-1]) + 2 + len(part) > width:
            lines[-1] += ","
            lines.append(part)
        else:
            lines[-1] += ", " + part
    return [indent + line for line in lines]


def _table(rows: dict[str, dict], indent: str) -> str:
    """Mapping of same-keyed objects, one per line, with aligned columns."""
    keys = [json.dumps(k) + ":" for k in rows]
    kw = max(map(len, keys))
    cells = [[_item(k, v) + "," for k, v in row.items()] for row in rows.values()]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    out = []
    for key, row in zip(keys, cells):
        text = " ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + " " + row[-1][:-1]
        out.append(f"{indent}{key.ljust(kw)} {{{text}}}")
    return ",\n".join(out)


def _manifest_text(m: dict) -> str:
    expected = ["crc32c", "format", "version", "cairn_version", "created_unix", "process_count", "root",
                "items", "metadata"]
    assert list(m) == expected, f"manifest fields changed: {list(m)} (update format_example.py)"
    return "\n".join([
        "{",
        f"  {_item('crc32c', m['crc32c'])},",
        f"  {_items({k: m[k] for k in expected[1:4]})},",
        f"  {_items({k: m[k] for k in expected[4:7]})},",
        '  "items": {',
        _table(m["items"], "    "),
        "  },",
        f"  {_item('metadata', m['metadata'])}",
        "}",
    ])


def _leaf_text(leaf: dict) -> str:
    """A leaf entry: its head, then grid and chunks, then sharding, on lines of their own."""
    lines: list[list[str]] = [[]]
    for k, v in leaf.items():
        if k in ("grid", "sharding") and lines[-1]:
            lines.append([])
        if k == "sharding":
            inner = _wrap([_item(a, b) for a, b in v.items()], " " * len('     "sharding": {'))
            lines[-1].append(_item(k, "")[:-2] + "{" + "\n".join(inner).lstrip() + "}")
        else:
            lines[-1].append(_item(k, v))
    out = []
    for i, parts in enumerate(lines):
        out += _wrap(parts, "    {" if i == 0 else "     ")
    return ",\n".join(out) + "}"


def _index_text(ix: dict) -> str:
    expected = ["crc32c", "format", "version", "block_size", "files", "structure", "leaves"]
    assert list(ix) == expected, f"index fields changed: {list(ix)} (update format_example.py)"
    return "\n".join([
        "{",
        f'  "crc32c": {json.dumps(ix["crc32c"])},',
        f'  "format": "{ix["format"]}", "version": {ix["version"]}, "block_size": {ix["block_size"]},',
        f'  "files": {json.dumps(ix["files"])},',
        f'  "structure": {json.dumps(ix["structure"])},',
        '  "leaves": [',
        ",\n".join(_leaf_text(leaf) for leaf in ix["leaves"]),
        "  ]",
        "}",
    ])


def _inline_index_text(ix: dict) -> str:
    """An index with inline leaves only, on as few lines as fit."""
    return "{" + "\n".join(_wrap([_item(k, v) for k, v in ix.items()], " ")).lstrip() + "}"


def _hex_rows(data: bytes) -> list[str]:
    """The data file of the example as 4-byte groups, annotated (w: 2 x 16 bytes, b: 4 bytes)."""
    assert len(data) == 36, len(data)
    w = np.frombuffer(data[:32], "<f4")
    b = np.frombuffer(data[32:], "<u2")
    rows = []
    for r in range(2):
        chunk = data[16 * r: 16 * (r + 1)]
        groups = " ".join(chunk[i: i + 4].hex() for i in range(0, 16, 4))
        vals = " ".join(str(float(v)) for v in w[4 * r: 4 * r + 4])
        note = f"w rows {2 * r}-{2 * r + 1}: {vals}" + (" (float32 LE)" if r == 0 else "")
        rows.append(f"{groups}   {note}")
    bf = np.frombuffer(data[32:], ml_dtypes.bfloat16)
    groups = " ".join(data[32 + i: 34 + i].hex() for i in (0, 2))
    rows.append(f"{groups.ljust(35)}   b: bfloat16 {float(bf[0])} (0x{int(b[0]):04x}), "
                f"{float(bf[1])} (0x{int(b[1]):04x})")
    return rows


def format_example(ckpt: Path) -> str:
    """The body of FORMAT.md §11, rendered from the files of the `step_5` golden."""
    manifest_bytes = (ckpt / "manifest.json").read_bytes()
    m = json.loads(manifest_bytes)
    token = re.fullmatch(r"index\.([0-9a-f]+)\.json", m["items"]["params"]["index"]).group(1)
    files = [ckpt / "manifest.json"]
    for name, item in m["items"].items():
        ix = json.loads((ckpt / item["dir"] / item["index"]).read_bytes())
        files.append(ckpt / item["dir"] / item["index"])
        if name == "params":
            files += [ckpt / item["dir"] / f["name"] for f in ix["files"]]
    rel = [f"step_5/{f.relative_to(ckpt).as_posix()}" for f in files]
    width = max(map(len, rel)) + 2
    listing = "\n".join(f"{r.ljust(width)}{f.stat().st_size:>5} bytes" for r, f in zip(rel, files))

    def index(name: str) -> dict:
        item = m["items"][name]
        return json.loads((ckpt / item["dir"] / item["index"]).read_bytes())

    params = index("params")
    data = (ckpt / "params" / params["files"][0]["name"]).read_bytes()
    return f"""\
Saving, with two JAX devices,

```python
mesh = jax.make_mesh((2,), ("x",))
w = jax.device_put(np.arange(8, dtype=np.float32).reshape(4, 2), NamedSharding(mesh, P("x")))
cairn.save("step_5", {{"params": {{"w": w, "b": np.array([0.5, -1.0], ml_dtypes.bfloat16)}},
                      "step": 5, "lr": 0.001}}, user_metadata={{"note": "example"}})
```

writes (token `{token}`):

```
{listing}
```

This checkpoint is committed as a golden test file, `tests/golden/v1/step_5/`
(`tests/format/test_golden.py` checks that the JSON below is exactly what those files
hold). cairn writes compact JSON (`json.dumps(obj, separators=(",", ":"))`:
no spaces, non-ASCII as `\\uXXXX`); it is shown indented here, with fields in
file order, so the compact form of each object below is the file's exact
bytes. `crc32c` is the CRC-32C of those bytes after the leading
`{{"crc32c":"…",` (§3).

`manifest.json`:

```json
{_manifest_text(m)}
```

`params/{m["items"]["params"]["index"]}`:

```json
{_index_text(params)}
```

`w` is sharded in two along axis 0, so its grid cuts axis 0 at 0, 2, 4 and
axis 1 not at all: two cells, rows 0–1 at bytes 0..16 and rows 2–3 at bytes
16..32 of the data file, each with one checksum (each chunk is smaller than
one block). `b` follows at bytes 32..36. The data file, in hexadecimal:

```
{chr(10).join(_hex_rows(data))}
```

`step/{m["items"]["step"]["index"]}` and `lr/{m["items"]["lr"]["index"]}` hold one
inline leaf each, at the empty key path, and no files:

```json
{_inline_index_text(index("step"))}
{_inline_index_text(index("lr"))}
```
"""


def update_format_md(ckpt: Path = V1 / "step_5", doc: Path = FORMAT_MD) -> None:
    text = doc.read_text()
    start = text.index("## 11. Worked example\n") + len("## 11. Worked example\n")
    end = text.index("\n## 12.")
    doc.write_text(text[:start] + "\n" + format_example(ckpt) + text[end:])




if __name__ == "__main__":
    update_format_md(Path(sys.argv[1]) if len(sys.argv) > 1 else V1 / "step_5")


# ----------------------------------------------------------------------------- §13: the v2 example

V2_HEADING = "## 13. The worked example in version 2"


def _v2_index_text(idx: dict) -> str:
    j = json.dumps
    lines = ["{", f'  "crc32c": {j(idx["crc32c"])},',
             f'  "format": "cairn-index", "version": {idx["version"]}, "block_size": {idx["block_size"]},',
             f'  "files": {j(idx["files"])},', f'  "processes": {idx["processes"]},',
             f'  "parts": {j(idx["parts"])},', f'  "structure": {j(idx["structure"])},', '  "leaves": [']
    for k, leaf in enumerate(idx["leaves"]):
        head = ", ".join(_item(key, leaf[key]) for key in ("path", "kind", "dtype", "shape"))
        rest = ", ".join(_item(key, leaf[key]) for key in leaf if key not in ("path", "kind", "dtype", "shape"))
        lines.append(f"    {{{head},\n     {rest}}}" + ("," if k + 1 < len(idx["leaves"]) else ""))
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def _v2_part_text(part: bytes, idx: dict) -> str:
    def row(bs: bytes, note: str) -> str:
        return " ".join(bs[i : i + 8].hex() for i in range(0, len(bs), 8)).ljust(72) + note

    n = int.from_bytes(part[24:32], "little")
    m = int.from_bytes(part[32:40], "little")
    out = [row(part[0:16], 'magic "CAIRNIDX", version 2, record size 40'),
           row(part[16:32], f"process {int.from_bytes(part[16:24], 'little')}, {n} records"),
           row(part[32:48], f"{m} checksums, the column at byte {int.from_bytes(part[40:48], 'little')}"),
           row(part[48:64], "zero, then the CRC-32C of bytes 0-59")]
    for r in range(n):
        rec = part[64 + 40 * r : 104 + 40 * r]
        leaf = int.from_bytes(rec[24:28], "little")
        name = idx["leaves"][leaf]["path"]
        cell, off, first = (int.from_bytes(rec[i : i + 8], "little") for i in (0, 8, 16))
        out.append(row(rec[:24], f"{name} cell {cell}: offset {off}, first checksum {first}"))
        out.append(row(rec[24:40], f"  leaf {leaf}, file {int.from_bytes(rec[28:32], 'little')}, "
                                   "CRC of its checksums, CRC of the record"))
    out.append(row(part[64 + 40 * n :], "the checksum column"))
    return "\n".join(out) + "\n"


def format_example_v2(ckpt: Path) -> str:
    m = json.loads((ckpt / "manifest.json").read_bytes())
    idx = json.loads((ckpt / "params" / m["items"]["params"]["index"]).read_bytes())
    part = (ckpt / "params" / idx["parts"][0]["name"]).read_bytes()
    w = idx["leaves"][0]
    return f"""
The save of §11, run by today's cairn, writes `tests/golden/v2/step_5`
(`tests/format/test_golden.py` checks what this section shows against those files).
The manifest is that of §11 with `"version": 2`; `step` and `lr` hold inline
values only, so their indexes are those of §11 with `"version": 2`. The
`params` index lists no chunks:

```json
{_v2_index_text(idx)}```

Process 0 wrote both of `w`'s shards, which follow each other along axis 0,
so they are one chunk (grid `{json.dumps(w["grid"])}`, writers
`{json.dumps(w["writers"])}`), and its bytes are those of §11's two chunks one
after the other; the data file is byte for byte that of §11. Process 0's part,
`params/{idx["parts"][0]["name"]}` ({len(part)} bytes), holds one record per
chunk in (leaf, cell) order, then the chunks' checksums (each chunk is smaller
than one block), in hexadecimal, 8 bytes per group:

```text
{_v2_part_text(part, idx)}```
"""


def update_format_md_v2(ckpt: Path = HERE / "v2" / "step_5", doc: Path = FORMAT_MD) -> None:
    text = doc.read_text()
    start = text.index(V2_HEADING + "\n") + len(V2_HEADING + "\n")
    end = text.find("\n## ", start)
    doc.write_text(text[:start] + format_example_v2(ckpt) + (text[end:] if end >= 0 else ""))
