"""Writes whose outcome is unknown, kept until a check settles them.

A PUT that timed out, or a SET whose reply never came, may have landed: the store may hold a
block its tier reported not stored. A shared store's tier announces what it stores in its
events (a fleet index follows them), so such a write is remembered here and checked later
(HEAD, STRLEN) by the tier's housekeeping: found there, it is announced; not there, forgotten.
A lookup's or a load's answer about the key settles it as well (the tier announces a block
found that way too).

:class:`WritesInDoubt` is the bookkeeping: bounded (the oldest doubt is dropped: a lookup's
check still finds its block, only the announcement is lost), oldest first, each write checked
no sooner than ``settle_after`` seconds after it failed (a slow server may still commit it),
with the rule for when a check may go out (:meth:`WritesInDoubt.may_check`). Not thread-safe:
the tier's lock guards it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvtier.keys import BlockKey

PROBE_INTERVAL = 1.0
"""Seconds between checks while the store's last request failed (see :meth:`WritesInDoubt.may_check`)."""


class WritesInDoubt:
    """Keys whose writes failed with their outcome unknown, oldest failure first, at most ``limit``."""

    def __init__(self, limit: int, settle_after: float, on_size: Callable[[int], None] | None = None) -> None:
        """``on_size``: called with the number of writes in doubt after each change (under the
        caller's lock; it must not block), e.g. to keep a ``writes_in_doubt`` gauge."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self.settle_after = settle_after
        self._failed_at: dict[BlockKey, float] = {}
        self._last_probe = float("-inf")
        self._on_size = on_size

    def __len__(self) -> int:
        return len(self._failed_at)

    def __contains__(self, key: object) -> bool:
        return key in self._failed_at

    def add(self, keys: Iterable[BlockKey], now: float) -> None:
        """The writes of ``keys`` failed at ``now`` with their outcome unknown (a key already in
        doubt moves to the end: its latest write decides when it is checked)."""
        failed = self._failed_at
        for key in keys:
            failed.pop(key, None)
            failed[key] = now
        while len(failed) > self.limit:
            del failed[next(iter(failed))]
        if self._on_size is not None:
            self._on_size(len(failed))

    def discard(self, key: BlockKey) -> bool:
        """Forget ``key``'s doubt (something newer answered for it); True if it was in doubt."""
        if self._failed_at.pop(key, None) is None:
            return False
        if self._on_size is not None:
            self._on_size(len(self._failed_at))
        return True

    def due(self, now: float, most: int) -> list[BlockKey]:
        """Up to ``most`` keys, oldest first, whose writes failed ``settle_after`` seconds ago or more."""
        out: list[BlockKey] = []
        ripe = now - self.settle_after
        for key, failed in self._failed_at.items():
            if failed > ripe or len(out) >= most:
                break
            out.append(key)
        return out

    def may_check(self, answering: bool, idle: bool, now: float) -> bool:
        """Whether a check may go out now. While the store answers (no failure since its last
        success): yes. While its last request failed, only from a worker with no work in hand
        and none waiting (``idle``), at most once per :data:`PROBE_INTERVAL`: a check sent to a
        server that hangs holds its I/O thread for a request's timeout, and any work that
        thread holds or would take; but with no other request going out it is the only one
        that can tell the store answers again (the caller then checks one key)."""
        if answering:
            return True
        if not idle or now - self._last_probe < PROBE_INTERVAL:
            return False
        self._last_probe = now
        return True
