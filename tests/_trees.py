"""Tree comparison shared by the reliability tests."""

from __future__ import annotations

from typing import Any

import numpy as np


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Bitwise equality of two loaded trees (dtype, shape and bytes of every array)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, got, want)
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (np.ndarray, np.generic)):
        g = np.asarray(got)
        assert g.dtype == want.dtype and g.shape == want.shape and g.tobytes() == np.asarray(want).tobytes(), where
    else:
        assert type(got) is type(want) and got == want, (where, got, want)
