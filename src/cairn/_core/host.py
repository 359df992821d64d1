"""Facts about the host this process runs on."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's share, where ``os.cpu_count``
    says the machine's), at least 1 and at most 64."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, 64))
