"""numpy <-> PyTorch interop: dtypes, zero-copy tensors, whole loaded trees.

PyTorch is optional and imported only when one of these is called.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import CheckpointError, UnsupportedTypeError
from .._format import values

# Same-width integer views numpy and torch share, used to hand ml_dtypes arrays to torch.
_VIEW_AS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise CheckpointError("this needs PyTorch, which is not installed (pip install 'cairn-ckpt[torch]')") from None
    return torch


def torch_dtype(dtype: np.dtype, where: str) -> Any:
    torch = import_torch()
    name = values.dtype_name(dtype) or str(dtype)
    t = getattr(torch, name, None)
    if not isinstance(t, torch.dtype):
        raise UnsupportedTypeError(f"{where}: dtype {name} has no PyTorch equivalent")
    return t


def numpy_to_torch(arr: np.ndarray, where: str) -> Any:
    """A torch tensor sharing `arr`'s memory, of the same dtype (bfloat16 stays bfloat16)."""
    torch = import_torch()
    t_dtype = torch_dtype(arr.dtype, where)
    arr = np.ascontiguousarray(arr)
    if arr.dtype.kind in "biufc" and arr.dtype.name not in ("uint16", "uint32", "uint64"):
        return torch.from_numpy(arr)
    # ml_dtypes (bfloat16, float8_*) and the wide unsigned ints: reinterpret the bytes.
    view = arr.view(_VIEW_AS[arr.dtype.itemsize])
    return torch.from_numpy(view).view(t_dtype)


def tree_to_torch(tree: Any, where: str) -> Any:
    """Replace every numpy array in a loaded tree by a torch tensor (zero-copy)."""
    if isinstance(tree, np.ndarray):
        return numpy_to_torch(tree, where)
    if isinstance(tree, dict):
        return {k: tree_to_torch(v, f"{where}/{k}") for k, v in tree.items()}
    if isinstance(tree, list):
        return [tree_to_torch(v, f"{where}/{i}") for i, v in enumerate(tree)]
    if isinstance(tree, tuple):
        kids = [tree_to_torch(v, f"{where}/{i}") for i, v in enumerate(tree)]
        return type(tree)(*kids) if hasattr(type(tree), "_fields") else tuple(kids)
    if type(tree).__module__.startswith(("jax", "jaxlib")):
        return numpy_to_torch(np.asarray(tree), where)
    return tree
