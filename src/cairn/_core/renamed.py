"""Old spellings of renamed public names: still accepted for one release, with a `DeprecationWarning`
that names the new one (docs/faq.md, "Names")."""

from __future__ import annotations

import warnings
from typing import Any


def renamed_keyword(where: str, new: str, new_value: Any, old: str, old_value: Any) -> Any:
    """The value of keyword `new` of `where`, given under its name or its deprecated one `old` (the one
    that is not None). `old` warns; both at once is a TypeError.

    Example:

        user_metadata = renamed_keyword("save", "user_metadata", user_metadata, "metadata", metadata)
    """
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"{where}() got both {new}= and its deprecated spelling {old}=; pass {new}= only")
    warnings.warn(f"{where}({old}=...) is deprecated and goes in the next release: pass {new}=...",
                  DeprecationWarning, stacklevel=3)
    return old_value


def renamed_method(where: str, new: str) -> None:
    """Warn that method `where` is deprecated in favour of `new` (call it from the old method)."""
    warnings.warn(f"{where}() is deprecated and goes in the next release: call {new}()", DeprecationWarning,
                  stacklevel=3)
