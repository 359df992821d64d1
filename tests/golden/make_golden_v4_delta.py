"""Write the format-version-4 golden `v4/delta` (delta blocks, FORMAT.md §6.5), once.

Three steps of one run in `v4/delta/`, 4 KiB blocks: `step_00000001`
self-contained with block hashes (compressed by measurement: `emb` is coded),
`step_00000002` against it (one row of `w`'s block 2 and a few `emb` values
changed: deltas against step 1's raw and coded blocks), `step_00000003`
against step 2 (`w`'s block 0 changed too: a new delta against step 1; block
2 unchanged since step 2: step 2's delta copied, still against step 1, so
the manifest's `bases` is `["step_00000001"]`). The values are written out
again in tests/save/test_incremental.py. Refuses to overwrite.

    PYTHONPATH=src JAX_PLATFORMS=cpu python tests/golden/make_golden_v4_delta.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from make_golden_v4 import write_chain  # this folder: the script's own

OUT = Path(__file__).parent / "v4" / "delta"


def state(step: int) -> dict:
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)  # 16 KiB: 4 blocks of 4 KiB
    emb = (np.arange(128 * 64) % 251).astype(ml_dtypes.bfloat16).reshape(128, 64)  # 16 KiB, compressible
    if step >= 2:
        w[40, :] += 0.5  # block 2
        emb[5, :4] = 7
    if step >= 3:
        w[3, :] += 0.25  # block 0
    return {"params": {"w": w, "emb": emb}, "step": step}


def main() -> int:
    return write_chain(OUT, state, "v4 delta golden")


if __name__ == "__main__":
    sys.exit(main())
