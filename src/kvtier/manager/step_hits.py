"""The step's CPU hits and whether its lookups are timed: the state the lookup fast path reads.

Owned by :class:`~kvtier.manager.core.TieringManager`; every call comes from
the engine's scheduler thread and only touches memory.
"""

from __future__ import annotations

from kvtier.keys import BlockKey

LOOKUP_TIMING_EVERY = 8
"""One engine step with lookups in this many has its lookups timed (its first
:data:`TIMED_LOOKUPS`), for the per-tier latency histograms; the other lookups' CPU hits take
the fast path, which times nothing and counts a HIT only by the key it logs anyway (a countdown
per lookup cost a sixth of a CPU hit). RETRY answers and the answers after them are always
timed."""

TIMED_LOOKUPS = 32
"""Lookups a timed step times at most, then the rest of its lookups take the fast path: a
latency sample per step is enough for the histograms, and a step of thousands of lookups would
otherwise pay two clock reads each (about 40 % more per CPU hit)."""


class StepHits:
    """The keys answered HIT this step: the engine may still ``prepare_load`` them in this step,
    so no eviction (for a store or a promotion) may take them before it ends; and whether the
    step's lookups are timed.

    A HIT only appends its key to ``log`` (never rebound: the lookup fast path holds its
    ``append``); the set is brought up to date from the log before an eviction may run.
    """

    __slots__ = ("flushed", "keys", "log", "samples", "timed", "untimed")

    def __init__(self) -> None:
        self.keys: set[BlockKey] = set()
        self.log: list[BlockKey] = []
        self.flushed = 0  # HITs logged before the log was last emptied
        self.timed = False  # this step's lookups are timed (see LOOKUP_TIMING_EVERY)
        self.untimed = 0  # steps with lookups until the next timed one: the first is timed
        self.samples = 0  # lookups this timed step still times

    def first_lookup(self, every: int) -> bool:
        """The step's first lookup: are the step's lookups timed (one step with lookups in
        ``every``, the first of all among them; False), or may they take the fast path (True)?"""
        if self.untimed:
            self.untimed -= 1
            return True
        self.untimed = every - 1
        self.timed = True
        self.samples = TIMED_LOOKUPS
        return False

    def sampled(self, n: int = 1) -> bool:
        """``n`` lookups of this timed step were timed: True once the step has its sample (it is
        untimed from now on, its lookups may take the fast path)."""
        self.samples -= n
        if self.samples > 0:
            return False
        self.timed = False
        return True

    def count(self) -> int:
        """Every HIT answered so far (each logs its key once: this is how HITs are counted)."""
        return self.flushed + len(self.log)

    def protected(self) -> set[BlockKey]:
        """The keys no eviction may take now."""
        if self.log:
            self.keys.update(self.log)
            self.flushed += len(self.log)
            self.log.clear()
        return self.keys

    def clear(self) -> None:
        """The step ended (or the cache was reset)."""
        self.keys.clear()
        self.flushed += len(self.log)
        self.log.clear()
        self.timed = False


__all__ = ["LOOKUP_TIMING_EVERY", "TIMED_LOOKUPS", "StepHits"]
