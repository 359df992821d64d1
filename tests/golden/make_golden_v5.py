"""Write the format-version-5 goldens (docs/FORMAT.md §6.6), once; each folder refuses to be overwritten.

- `v5/blosc2`: one save with `compression="blosc2"` (every array leaf's blocks
  C-Blosc2 chunks, §6.4), no block hashes: its manifest says version 5, its
  index keeps version 3's layout (codec named per leaf). 4 KiB blocks.
- `v5/blosc2_chain`: three steps of one run (`make_golden_v4.write_chain`):
  `step_00000001` self-contained with block hashes, `blosc2`-coded (part codec
  id 4); `step_00000002` raw, against it: a changed block of `w` a delta against
  a blosc2 block, the rest references to blosc2 blocks (version 5 although it
  codes nothing with blosc2 itself); `step_00000003` against step 2.
- `v5/sparse`: three steps of one run: `step_00000001` self-contained,
  `planes`-coded (no blosc2, no sparse delta: version 4, as before version 5
  existed), `step_00000002` and `step_00000003` with sparse deltas (kind 1,
  §6.5) against it: version 5.

The values are written out again in tests/format/test_golden_v5.py. Needs
python-blosc2 (`cairn-ckpt[fast]`).

    PYTHONPATH=src JAX_PLATFORMS=cpu python tests/golden/make_golden_v5.py
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

OUT = Path(__file__).parent / "v5"


def blosc2_state() -> dict:
    rng = np.random.default_rng(55)
    return {"params": {"w": rng.normal(0, 0.02, (64, 128)).astype(ml_dtypes.bfloat16),  # 16 KiB: 4 blocks
                       "ids": (np.arange(3000, dtype=np.int32) % 7),
                       "zeros": np.zeros((1024,), np.float32)},
            "step": 5}


def chain_state(step: int) -> dict:
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)  # 16 KiB: 4 blocks of 4 KiB
    emb = (np.arange(128 * 64) % 251).astype(ml_dtypes.bfloat16).reshape(128, 64)
    if step >= 2:
        w[40, :] = -2.0  # block 2
    if step >= 3:
        emb[0, :4] = 9.0  # block 0
    return {"params": {"w": w, "emb": emb}, "step": step}


def sparse_state(step: int) -> dict:
    i16 = (np.arange(64 * 128) % 1000).astype(np.int16).reshape(64, 128)  # 16 KiB: 4 blocks of 4 KiB
    f32 = np.linspace(-1, 1, 64 * 64, dtype=np.float32).reshape(64, 64)
    if step >= 2:  # block 1 of each: a few elements
        i16[20, [0, 7, 100]] = -300
        f32[20, [1, 62]] = 4.5
    if step >= 3:  # block 2 too
        i16[40, 5] = 12345
        f32[40, [0, 1, 2]] = -0.125
    return {"params": {"i16": i16, "f32": f32}, "step": step}


def write_blosc2(out: Path) -> int:
    if out.exists():
        print(f"{out} exists; goldens are never regenerated", file=sys.stderr)
        return 1
    loc = resolve(out)
    job = _save.prepare(loc, blosc2_state(), block_size=4096, compression="blosc2", metadata={"note": "v5 blosc2 golden"})
    job.run()
    print(f"wrote {loc.path} with cairn {cairn.__version__}")
    return 0


def main() -> int:
    OUT.mkdir(exist_ok=True)
    return (write_blosc2(OUT / "blosc2")
            | write_chain(OUT / "blosc2_chain", chain_state, "v5 blosc2 chain golden", first="blosc2")
            | write_chain(OUT / "sparse", sparse_state, "v5 sparse golden", first="planes"))


if __name__ == "__main__":
    sys.exit(main())
