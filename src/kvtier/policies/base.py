"""The eviction-policy contract used by the CPU primary tier.

The primary tier owns ref counts; a policy only orders keys. The tier tells the
policy when a block becomes evictable (ref count 0) and when it stops being
evictable (pinned or in flight), so ``evict`` only ever visits evictable keys:
pinned blocks are never scanned.

Call order per key: ``insert`` (new block, not yet evictable) ->
``mark_evictable`` / ``mark_pinned`` any number of times -> ``remove`` or
eviction. ``touch`` is a recency hint and may come for pinned keys.
All calls come from the scheduler thread.
"""

from __future__ import annotations

import abc
from collections.abc import Container
from typing import ClassVar

from kvtier.keys import BlockKey


class EvictionPolicy(abc.ABC):
    name: ClassVar[str] = "abstract"

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"policy capacity must be positive, got {capacity}")
        self.capacity = capacity

    @abc.abstractmethod
    def insert(self, key: BlockKey) -> None:
        """A new block was allocated (not evictable until ``mark_evictable``)."""

    @abc.abstractmethod
    def remove(self, key: BlockKey) -> None:
        """The block was removed by the tier (not an eviction)."""

    @abc.abstractmethod
    def touch(self, key: BlockKey) -> None:
        """The block was used (recency)."""

    @abc.abstractmethod
    def mark_evictable(self, key: BlockKey) -> None:
        """The block's ref count became 0."""

    @abc.abstractmethod
    def mark_pinned(self, key: BlockKey) -> None:
        """The block's ref count left 0 (a reader pinned it)."""

    @abc.abstractmethod
    def evict(self, n: int, protected: Container[BlockKey] = ()) -> list[BlockKey] | None:
        """Choose and forget ``n`` evictable keys not in ``protected``.

        Atomic: returns None and changes nothing if fewer than ``n`` qualify.
        """

    @abc.abstractmethod
    def clear(self) -> None:
        """Forget everything."""

    @abc.abstractmethod
    def evictable_count(self) -> int:
        """How many keys could be evicted right now."""
