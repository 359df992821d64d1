"""A bounded memo for per-(sharding, shape) work: a dict that forgets everything when full,
and caches nothing for an unhashable key (a user sharding may be one)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

V = TypeVar("V")


class Memo(Generic[V]):
    def __init__(self, limit: int = 4096) -> None:
        self._d: dict[Any, V] = {}
        self.limit = limit

    def get(self, key: Any) -> V | None:
        try:
            return self._d.get(key)
        except TypeError:  # unhashable
            return None

    def put(self, key: Any, value: V) -> V:
        """Remember `value` under `key` (where hashable); returns `value`."""
        try:
            hash(key)
        except TypeError:
            return value
        if len(self._d) >= self.limit:
            self._d.clear()
        self._d[key] = value
        return value

    def clear(self) -> None:
        self._d.clear()
