"""Figures for people: byte counts in binary units."""

from __future__ import annotations


def human_bytes(n: float | None) -> str:
    """`n` bytes as ``"512 B"``, ``"1.5 KiB"`` ... ``"3.0 PiB"``; ``"-"`` for None (unknown)."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"
