"""Write the format-version-6 goldens (docs/FORMAT.md §6.6), once; each folder refuses to be overwritten.

Version 6 is version 5's rule for codec `blosc2-lz4` (§6.4: one C-Blosc2 chunk
per block, the bit shuffle, Blosc filter 2, then LZ4 at level 5; id 5 in a
part's source column), whose chunks a reader of version 5 rejects as corrupt
(it reads filters 0 and 1 only): a checkpoint with any such block, its own, a
reference to one or a delta against one, has a manifest of version 6; its
indexes keep their layout's version (3 or 4). 4 KiB blocks throughout.

- `v6/blosc2_lz4`: one save with `compression="blosc2-lz4"`, no block hashes:
  manifest 6, index 3, every array leaf `"codec":"blosc2-lz4"`; leaves of 1, 2,
  4, 8 and 16-byte elements, short last blocks, an all-zero leaf.
- `v6/blosc2_lz4_chain`: three steps of one run (`make_golden_v4.write_chain`):
  `step_00000001` self-contained with block hashes, `blosc2-lz4`-coded (part
  codec id 5); `step_00000002` raw against it: a changed block of `w` a delta
  against a `blosc2-lz4` block, the rest references to `blosc2-lz4` blocks
  (version 6 although it codes nothing with `blosc2-lz4` itself);
  `step_00000003` against step 2.
- `v6/mixed`: two steps: `step_00000001` `blosc2`-coded with block hashes
  (version 5), `step_00000002` with `compression="blosc2-lz4"` against it: a
  new leaf's blocks `blosc2-lz4` (id 5) beside references to `blosc2` blocks
  (id 4): version 6, the highest its blocks need.

The values are written out again in tests/format/test_golden_v6.py. Needs
python-blosc2 (`cairn-ckpt[fast]`).

    PYTHONPATH=src JAX_PLATFORMS=cpu python tests/golden/make_golden_v6.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from make_golden_v4 import write_chain  # this folder: the script's own

import cairn
from cairn._save import engine as _save
from cairn._storage.location import resolve

OUT = Path(__file__).parent / "v6"


def lz4_state() -> dict:
    rng = np.random.default_rng(66)
    return {"params": {"w": rng.normal(0, 0.02, (64, 128)).astype(ml_dtypes.bfloat16),  # 16 KiB: 4 blocks
                       "ids": np.arange(3000, dtype=np.int32) % 7,  # 11.7 KiB: a short last block
                       "mask": (np.arange(5000) % 13 == 0).astype(np.uint8),  # 1-byte elements
                       "f64": np.linspace(-1, 1, 600),  # 8-byte elements
                       "c128": np.arange(300) * (1 + 2j) / 7,  # 16-byte elements
                       "zeros": np.zeros((1024,), np.float32)},  # one block of zeros
            "step": 6}


def chain_state(step: int) -> dict:
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)  # 16 KiB: 4 blocks of 4 KiB
    emb = (np.arange(128 * 64) % 251).astype(ml_dtypes.bfloat16).reshape(128, 64)
    if step >= 2:
        w[40, :] = -2.0  # block 2
    if step >= 3:
        emb[0, :4] = 9.0  # block 0
    return {"params": {"w": w, "emb": emb}, "step": step}


def mixed_state(step: int) -> dict:
    state = chain_state(step)
    if step >= 2:  # a leaf the base does not have: its blocks coded by step 2's codec
        state["params"]["new"] = (np.arange(64 * 64) % 97 - 48).astype(np.int16).reshape(64, 64)  # 8 KiB: 2 blocks
    return state


def write_lz4(out: Path) -> int:
    if out.exists():
        print(f"{out} exists; goldens are never regenerated", file=sys.stderr)
        return 1
    loc = resolve(out)
    job = _save.prepare(loc, lz4_state(), block_size=4096, compression="blosc2-lz4",
                        metadata={"note": "v6 blosc2-lz4 golden"})
    job.run()
    print(f"wrote {loc.path} with cairn {cairn.__version__}")
    return 0


def write_mixed(out: Path) -> int:
    if out.exists():
        print(f"{out} exists; goldens are never regenerated", file=sys.stderr)
        return 1
    out.mkdir(parents=True)
    for step, base, compression in ((1, None, "blosc2"), (2, 1, "blosc2-lz4")):
        loc = resolve(out / f"step_{step:08d}")
        kw = {"hashes": True} if base is None else {"base": resolve(out / f"step_{base:08d}"), "hashes": True}
        job = _save.prepare(loc, mixed_state(step), block_size=4096, min_file_bytes=16384, compression=compression,
                            metadata={"note": "v6 mixed golden"}, **kw)
        job.run()
        print(f"wrote {loc.path} with cairn {cairn.__version__}")
    return 0


def main(out: Path = OUT) -> int:
    out.mkdir(exist_ok=True)
    return (write_lz4(out / "blosc2_lz4")
            | write_chain(out / "blosc2_lz4_chain", chain_state, "v6 blosc2-lz4 chain golden", first="blosc2-lz4")
            | write_mixed(out / "mixed"))


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
