"""Write the format-version-4 golden `v4/chain` (incremental checkpoints, FORMAT.md §6.5), once.

Three steps of one run in `v4/chain/`, 4 KiB blocks so that small arrays have
several blocks: `step_00000001` self-contained with block hashes (compressed
by measurement, so some blocks are coded), `step_00000002` against it (raw:
one block of `w` changed, the rest references, some to coded blocks),
`step_00000003` against step 2 (another block of `w` changed: its references
point at step 1's and step 2's own bytes, never at a reference). The values
are written out again in tests/save/test_incremental.py. Refuses to overwrite.

    PYTHONPATH=src JAX_PLATFORMS=cpu python tests/golden/make_golden_v4.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

import cairn
from cairn._save import engine as _save
from cairn._storage.location import resolve

OUT = Path(__file__).parent / "v4" / "chain"


def state(step: int) -> dict:
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)  # 16 KiB: 4 blocks of 4 KiB
    if step >= 2:
        w[40, :] = -2.0  # block 2
    if step >= 3:
        w[3, :] = -3.0  # block 0
    emb = (np.arange(128 * 64) % 251).astype(ml_dtypes.bfloat16).reshape(128, 64)  # 16 KiB, compressible
    return {"params": {"w": w, "emb": emb, "ids": np.arange(10, dtype=np.int32)}, "step": step}


def write_chain(out: Path, state: Callable[[int], dict], note: str, first: bool | str = True) -> int:
    """Steps 1-3 of `state` into `out` (refused if it exists): step 1 self-contained with block hashes and
    compressed with `first` (True: by measurement), steps 2 and 3 raw, each against the step before."""
    if out.exists():
        print(f"{out} exists; goldens are never regenerated", file=sys.stderr)
        return 1
    out.mkdir(parents=True)
    for step, base, compression in ((1, None, first), (2, 1, False), (3, 2, False)):
        loc = resolve(out / f"step_{step:08d}")
        kw = {"hashes": True} if base is None else {"base": resolve(out / f"step_{base:08d}"), "hashes": True}
        job = _save.prepare(loc, state(step), block_size=4096, min_file_bytes=16384, compression=compression,
                            metadata={"note": note}, **kw)  # the internal prepare: user_metadata is the public name
        job.run()
        print(f"wrote {loc.path} with cairn {cairn.__version__}")
    return 0


def main() -> int:
    return write_chain(OUT, state, "v4 golden")


if __name__ == "__main__":
    sys.exit(main())
