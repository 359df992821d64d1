"""Write the format-version-4 golden `v4/sparse` (sparse delta blocks, FORMAT.md §6.5), once.

Three steps of one run in `v4/sparse/`, 4 KiB blocks, four leaves of 16 KiB
(4 blocks each) with elements of 1, 2, 4 and 8 bytes: `step_00000001`
self-contained with block hashes (`planes`-coded: no optional codec), `step_00000002`
against it (a few elements of one block of each leaf changed: sparse deltas,
kind 1, against step 1's blocks), `step_00000003` against step 2 (one more
block of each leaf changed: new sparse deltas against step 1; step 2's
deltas copied, one hop, so `bases` is `["step_00000001"]`). The values are
written out again in tests/save/test_incremental.py. Refuses to overwrite.

    PYTHONPATH=src JAX_PLATFORMS=cpu python tests/golden/make_golden_v4_sparse.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from make_golden_v4 import write_chain  # this folder: the script's own

OUT = Path(__file__).parent / "v4" / "sparse"


def state(step: int) -> dict:
    u8 = (np.arange(128 * 128) % 7).astype(np.uint8).reshape(128, 128)  # 16 KiB: 4 blocks of 4 KiB
    bf = (np.arange(64 * 128) % 251).astype(ml_dtypes.bfloat16).reshape(64, 128)
    f32 = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    f64 = np.arange(32 * 64, dtype=np.float64).reshape(32, 64)
    if step >= 2:  # block 1 of each: a few elements
        u8[40, [0, 3, 100]] = 200
        bf[20, [1, 2, 90]] = -1.5
        f32[20, [0, 63]] = -7.25
        f64[10, [5, 6, 7]] = 1e300
    if step >= 3:  # block 3 too (block 1 unchanged since step 2)
        u8[127, 127] = 255
        bf[60, 0] = 3.0
        f32[60, 10] = 0.5
        f64[31, 63] = -0.0
    return {"params": {"u8": u8, "bf16": bf, "f32": f32, "f64": f64}, "step": step}


def main() -> int:
    return write_chain(OUT, state, "v4 sparse golden", first="planes")


if __name__ == "__main__":
    sys.exit(main())
