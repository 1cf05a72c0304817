"""Least-recently-used eviction over evictable blocks only.

Invariant: ``_evictable`` holds exactly the keys with ref count 0, least
recently used first. A pinned block leaves it and re-enters as most recent
when released (it was just used).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from typing import ClassVar

from kvtier.keys import BlockKey
from kvtier.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name: ClassVar[str] = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._evictable: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey) -> None:
        pass

    def remove(self, key: BlockKey) -> None:
        self._evictable.pop(key, None)

    def touch(self, key: BlockKey) -> None:
        if key in self._evictable:
            self._evictable.move_to_end(key)

    def mark_evictable(self, key: BlockKey) -> None:
        self._evictable[key] = None

    def mark_pinned(self, key: BlockKey) -> None:
        self._evictable.pop(key, None)

    def evict(self, n: int, protected: Container[BlockKey] = ()) -> list[BlockKey] | None:
        if n <= 0:
            return []
        if n > len(self._evictable):
            return None
        chosen: list[BlockKey] = []
        for key in self._evictable:
            if key not in protected:
                chosen.append(key)
                if len(chosen) == n:
                    break
        else:
            return None
        for key in chosen:
            del self._evictable[key]
        return chosen

    def clear(self) -> None:
        self._evictable.clear()

    def evictable_count(self) -> int:
        return len(self._evictable)
