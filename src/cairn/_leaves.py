"""What each leaf of a state is, and how user types become bytes.

Leaves are classified once, when a save is requested, so that an unsupported
leaf fails before anything is written, with its key path in the message.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import UnsupportedTypeError
from ._tree import display_path
from ._values import dtype_name, value_kind


@dataclass(frozen=True)
class Handler:
    name: str
    type: type
    save: Callable[[Any], bytes]
    load: Callable[[bytes], Any]


_handlers: dict[str, Handler] = {}
_lock = threading.Lock()


def register_type(
    typ: type, save: Callable[[Any], bytes], load: Callable[[bytes], Any], name: str | None = None
) -> None:
    """Teach cairn to store objects of `typ` as bytes.

    `save(obj)` must return ``bytes``; `load(data)` must rebuild the object.
    The handler's `name` (by default the type's qualified name) is recorded in
    the checkpoint, so a loader registers the same name to read it back.

    Example::

        cairn.register_type(MyIterState, save=lambda s: s.to_bytes(),
                            load=MyIterState.from_bytes)
    """
    name = name or f"{typ.__module__}.{typ.__qualname__}"
    with _lock:
        _handlers[name] = Handler(name, typ, save, load)


def handler_for_object(x: Any) -> Handler | None:
    for h in _handlers.values():
        if type(x) is h.type:
            return h
    for h in _handlers.values():
        if isinstance(x, h.type):
            return h
    return None


def handler_named(name: str) -> Handler | None:
    return _handlers.get(name)


def is_jax_array(x: Any) -> bool:
    t = type(x)
    if not t.__module__.startswith(("jax", "jaxlib")):
        return False
    import jax

    return isinstance(x, jax.Array)


@dataclass
class ArraySource:
    """An array leaf to be saved: a jax.Array, or host bytes written by process 0."""

    path: str
    kind: str  # "array" | "bytes" | "object"
    value: Any  # the jax.Array or the np.ndarray (for bytes/objects: a uint8 array)
    is_jax: bool
    handler: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.value.dtype)


@dataclass
class ValueSource:
    path: str
    kind: str
    value: Any


def classify(path: str, x: Any, where: str, item: str = "") -> ArraySource | ValueSource:
    """Decide how leaf `x` at key `path` is stored; raise UnsupportedTypeError if it cannot be."""
    kind = value_kind(x)
    if kind is not None:
        return ValueSource(path, kind, x)
    if isinstance(x, np.ndarray):
        if dtype_name(x.dtype) is None:
            raise UnsupportedTypeError(
                f"{where}: leaf {display_path(path, item)!r} is a numpy array of dtype {x.dtype}, "
                "which cairn cannot store (object, string and structured dtypes are not supported)"
            )
        if x.dtype.byteorder == ">":
            x = x.astype(x.dtype.newbyteorder("<"))
        return ArraySource(path, "array", x, False)
    if isinstance(x, (bytes, bytearray, memoryview)):
        return ArraySource(path, "bytes", np.frombuffer(bytes(x), dtype=np.uint8), False)
    if is_jax_array(x):
        if dtype_name(np.dtype(x.dtype)) is None:
            raise UnsupportedTypeError(f"{where}: leaf {display_path(path, item)!r} has unsupported dtype {x.dtype}")
        if x.is_deleted():
            raise UnsupportedTypeError(f"{where}: leaf {display_path(path, item)!r} is a deleted (donated) jax.Array")
        return ArraySource(path, "array", x, True)
    h = handler_for_object(x)
    if h is not None:
        data = h.save(x)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise UnsupportedTypeError(
                f"{where}: handler {h.name!r} returned {type(data).__name__} for leaf "
                f"{display_path(path, item)!r}; it must return bytes"
            )
        return ArraySource(path, "object", np.frombuffer(bytes(data), dtype=np.uint8), False, h.name)
    if type(x).__name__ == "ShapeDtypeStruct":
        raise UnsupportedTypeError(
            f"{where}: leaf {display_path(path, item)!r} is an abstract jax.ShapeDtypeStruct; save concrete arrays"
        )
    raise UnsupportedTypeError(
        f"{where}: leaf {display_path(path, item)!r} has type {type(x).__module__}.{type(x).__qualname__}, "
        "which cairn cannot store; register a handler with cairn.register_type"
    )
