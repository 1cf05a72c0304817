"""What a bench or replay run will allocate, checked against the memory there is before anything is allocated.

``kvtier bench`` and ``kvtier replay`` size their allocations from numbers a user
types (``--device-blocks``, ``--sessions``, ``--capacity``, ``--requests``). A
typo must not make the machine swap or the process die half-way: each run adds
up what it will hold (:class:`MemoryNeed` items, estimates stated where they are
computed) and :func:`check_memory` refuses the run, naming the flags to lower,
when the total exceeds the share of memory that is available now
(``MemAvailable`` of ``/proc/meminfo``, lowered by a cgroup v2 limit).

Plain functions; any thread; reads two small files in /proc and /sys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.units import format_size

USABLE_SHARE = 0.5
"""The share of available memory one run may plan to use: a benchmark must leave the machine usable (the
rest is for the system, the tiers' threads and whatever else runs)."""


@dataclass(frozen=True)
class MemoryNeed:
    """One part of a run's memory: what it is (``"device pool"``), bytes, and the flag that sizes it."""

    what: str
    bytes: int
    flag: str


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path, encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_available(root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes left under this process's cgroup v2 memory limit (``memory.max - memory.current``), if limited."""
    with contextlib.suppress(OSError, ValueError):
        with open(f"{root}/memory.max", encoding="ascii") as handle:
            limit = handle.read().strip()
        if limit == "max":
            return None
        with open(f"{root}/memory.current", encoding="ascii") as handle:
            current = int(handle.read().strip())
        return max(0, int(limit) - current)
    return None


def available_memory() -> int | None:
    """Bytes of memory available to this process now, or None if the system does not say."""
    known = [n for n in (_meminfo_available(), _cgroup_available()) if n is not None]
    return min(known) if known else None


def check_memory(needs: Sequence[MemoryNeed], available: int | None = None) -> None:
    """Raise :class:`ConfigError` when ``needs`` add up to more than :data:`USABLE_SHARE` of ``available``.

    ``available`` defaults to :func:`available_memory`; when that is unknown the
    run is allowed. The message names the total, its largest parts with their
    flags, what is available, and which flags to lower.
    """
    if available is None:
        available = available_memory()
    total = sum(n.bytes for n in needs)
    if available is None or total <= USABLE_SHARE * available:
        return
    parts = sorted((n for n in needs if n.bytes > 0), key=lambda n: -n.bytes)
    listed = ", ".join(f"{n.what} {format_size(n.bytes)} ({n.flag})" for n in parts[:3])
    flags = " or ".join(dict.fromkeys(n.flag for n in parts[:2]))
    raise ConfigError(
        f"this run needs about {format_size(total)} of memory ({listed}) but {format_size(available)} is available "
        f"(a run may plan to use {USABLE_SHARE:.0%} of it): lower {flags}"
    )


__all__ = ["USABLE_SHARE", "MemoryNeed", "available_memory", "check_memory"]
