"""Budget sources: callables a running step polls between micro-batches (``step.budget_source = ...``).

A source returns the memory budget in force (bytes), or None for "unchanged". The built-in one reads
what the operating system lets this process have: the cgroup v2 (or v1) memory limit of the container,
and the system's available memory, minus what the process held before training (its import baseline)
and a reserve for everything else on the device.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from ..profile import memory
from ..profile.memory import available_bytes

__all__ = ["cgroup_limit_bytes", "available_bytes", "system_budget_source"]

log = logging.getLogger(__name__)
_CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
_CGROUP_USAGE = ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes")


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= 1 << 60 else value  # cgroup v1 writes a huge number for "no limit"


def cgroup_limit_bytes() -> int | None:
    """The memory limit of this process's cgroup, or None where there is none."""
    for f in _CGROUP_FILES:
        v = _read_int(f)
        if v is not None:
            return v
    return None


def system_budget_source(reserve_bytes: int = 64 << 20, cap_bytes: int | None = None,
                         min_change: float = 0.02) -> Callable[[], int | None]:
    """A budget source from the cgroup limit and the memory the system has available.

    The budget is what this process may still grow to above its import baseline: the smaller of the
    cgroup headroom (limit minus the cgroup's usage by others) and the system's available memory, plus
    what training already holds, minus ``reserve_bytes``; capped at ``cap_bytes``. Changes smaller than
    ``min_change`` (relative) are ignored so noise does not cause re-planning.
    """
    last: list[int] = []

    def source() -> int | None:
        held = max(0, memory.rss_bytes() - memory.baseline_rss_bytes())
        candidates = []
        avail = available_bytes()
        if avail is not None:
            candidates.append(avail + held)
        limit = cgroup_limit_bytes()
        if limit is not None:
            usage = next((u for u in map(_read_int, _CGROUP_USAGE) if u is not None), None)
            others = max(0, (usage or 0) - memory.rss_bytes())
            candidates.append(limit - others - memory.baseline_rss_bytes())
        if not candidates:
            return None
        budget = min(candidates) - reserve_bytes
        if cap_bytes is not None:
            budget = min(budget, cap_bytes)
        if last and abs(budget - last[0]) <= min_change * last[0]:
            return None
        last[:] = [budget]
        log.debug("system budget source: %d bytes", budget)
        return budget

    return source
