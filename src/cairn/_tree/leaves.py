"""What each leaf of a state is, and how user types become bytes.

Leaves are classified once, when a save is requested, so that an unsupported
leaf fails before anything is written, with its key path in the message.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import MismatchError, UnsupportedTypeError
from .._format.values import dtype_name, value_kind
from .pytree import display_path


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

    Example:

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
    """An array leaf to be saved: a jax.Array, or host bytes written by one process (`owner`)."""

    path: str
    kind: str  # "array" | "bytes" | "object" | "prng_key"
    value: Any  # the jax.Array or the np.ndarray (bytes/objects: a uint8 array; keys: their key data)
    is_jax: bool
    handler: str | None = None
    impl: str | None = None  # prng_key: the key implementation's name
    impl_shape: tuple[int, ...] = ()  # prng_key: the key data's trailing dimensions
    owner: int = 0  # a host-local leaf: the process that writes it (per-process values: each its own)

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
        import jax

        if isinstance(x, jax.core.Tracer):
            raise UnsupportedTypeError(
                f"{where}: leaf {display_path(path, item)!r} is a traced value ({type(x).__name__}); "
                "call cairn.save outside jax.jit, grad and vmap, with concrete arrays"
            )
        if x.is_deleted():
            raise UnsupportedTypeError(f"{where}: leaf {display_path(path, item)!r} is a deleted (donated) jax.Array")
        if is_key_dtype(x.dtype):
            key_data = jax.random.key_data(x)  # uint32, the key's sharding extended over the impl's dimensions
            impl = str(jax.random.key_impl(x))
            return ArraySource(path, "prng_key", key_data, True, impl=impl, impl_shape=tuple(key_data.shape[x.ndim:]))
        if dtype_name(np.dtype(x.dtype)) is None:
            raise UnsupportedTypeError(f"{where}: leaf {display_path(path, item)!r} has unsupported dtype {x.dtype}")
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
    if callable(x):
        raise UnsupportedTypeError(
            f"{where}: leaf {display_path(path, item)!r} is {_callable_text(x)}, which is code, not state; "
            "save only the arrays of a model that holds functions: for an Equinox module, "
            "params, static = eqx.partition(model, eqx.is_array); cairn.save(path, params); "
            "then model = eqx.combine(cairn.load(path, params), static)"
        )
    raise UnsupportedTypeError(
        f"{where}: leaf {display_path(path, item)!r} has type {type(x).__module__}.{type(x).__qualname__}, "
        "which cairn cannot store; register a handler with cairn.register_type"
    )


def _callable_text(x: Any) -> str:
    name = getattr(x, "__qualname__", None) or getattr(x, "__name__", None)
    module = getattr(x, "__module__", None)
    shown = f"{module}.{name}" if isinstance(name, str) and isinstance(module, str) else None
    if isinstance(x, type):
        return f"the class {shown or repr(x)}"
    kind = f"{type(x).__module__}.{type(x).__qualname__}"
    return f"the function {shown} ({kind})" if shown else f"a callable of type {kind}"


def is_key_dtype(dtype: Any) -> bool:
    """Whether `dtype` is a typed PRNG key dtype (``jax.random.key(...).dtype``)."""
    if dtype is None or isinstance(dtype, np.dtype) or not type(dtype).__module__.startswith("jax"):
        return False
    import jax

    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def check_key_target(target: Any, leaf: Any, where: str) -> None:
    """Raise MismatchError unless key-dtype `target` (or a sharding) can hold prng_key `leaf`."""
    import jax

    if isinstance(target, jax.sharding.Sharding):
        return
    if tuple(target.shape) != leaf.key_shape:
        raise MismatchError(f"{where} holds keys of shape {leaf.key_shape} but the target's are {tuple(target.shape)}")
    impl = getattr(getattr(target.dtype, "_impl", None), "name", None)  # no public accessor for a dtype's impl
    if isinstance(impl, str) and impl != leaf.impl:
        raise MismatchError(f"{where} holds {leaf.impl} keys but the target's are {impl} keys")


@functools.lru_cache(maxsize=64)
def key_dtype(impl: str) -> Any:
    """The JAX key dtype of implementation `impl`, or None (no JAX, or an implementation it does not know)."""
    try:
        import jax

        return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype
    except Exception:  # ImportError, or JAX's error for an unknown implementation name
        return None


def wrap_key(data: Any, impl: str, where: str) -> Any:
    """Typed keys from their uint32 key data, on the same devices.

    The keys' sharding is the data's over the key axes; JAX spells some of
    them its own way (a replicated ``P()`` comes back as ``P(None)``), but it
    is equivalent to the target's.
    """
    import jax

    try:
        return jax.random.wrap_key_data(data, impl=impl)
    except (ValueError, TypeError, KeyError) as e:
        raise MismatchError(f"{where}: cannot rebuild keys of implementation {impl!r}: {e}") from None
