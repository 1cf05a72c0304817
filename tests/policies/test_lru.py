"""LRUPolicy: least recently used first, over evictable blocks only.

White-box where the contract is about internal state: the slot-indexed linked
list (``_prev``/``_next`` through the sentinel slot ``capacity``), the
``_evictable`` flags and ``_key_of``.
"""

from __future__ import annotations

import gc
import os
import tracemalloc

import pytest
from hypothesis import settings
from hypothesis.stateful import invariant
from policy_helpers import ProtocolMachine, ReferencePolicy, ScanSpy, Slotted, key

from kvtier.keys import BlockKey
from kvtier.policies import LRUPolicy


def ready(policy: Slotted[LRUPolicy], *ids: int) -> None:
    """Insert and complete keys ``ids`` in order (each becomes evictable, most recent last)."""
    for i in ids:
        policy.insert(key(i))
        policy.mark_evictable(key(i))


def linked_keys(tier: Slotted[LRUPolicy]) -> list[BlockKey]:
    """The evictable keys in list order, after checking the list's structure."""
    policy = tier.policy
    end = policy.capacity
    slots: list[int] = []
    slot = policy._next[end]
    while slot != end:
        assert len(slots) < end, "the list has a cycle"
        assert policy._next[policy._prev[slot]] == slot
        slots.append(slot)
        slot = policy._next[slot]
    assert policy._prev[end] == (slots[-1] if slots else end)
    assert sorted(slots) == [s for s in range(end) if policy._evictable[s]]
    assert len(slots) == policy.evictable_count()
    key_of = {s: k for k, s in tier.slot_of.items()}
    assert all(policy._key_of[s] == key_of.get(s, b"") for s in range(end)), "_key_of is stale"
    return [policy._key_of[s] for s in slots]


def test_empty_policy_evicts_nothing() -> None:
    policy = Slotted(LRUPolicy(4))
    assert policy.evict(0) == []
    assert policy.evict(1) is None
    assert policy.evictable_count() == 0


def test_inserted_block_is_not_evictable_until_marked() -> None:
    policy = Slotted(LRUPolicy(4))
    policy.insert(key(1))
    assert policy.evictable_count() == 0
    assert policy.evict(1) is None
    policy.mark_evictable(key(1))
    assert policy.evict(1) == [key(1)]
    assert policy.evictable_count() == 0


def test_evicts_least_recently_used_first() -> None:
    policy = Slotted(LRUPolicy(8))
    ready(policy, 1, 2, 3, 4)
    assert policy.evict(2) == [key(1), key(2)]
    assert policy.evict(2) == [key(3), key(4)]
    assert policy.evict(1) is None


def test_recency_is_when_the_block_became_evictable() -> None:
    policy = Slotted(LRUPolicy(8))
    for i in (1, 2):
        policy.insert(key(i))
    policy.mark_evictable(key(2))
    policy.mark_evictable(key(1))
    assert policy.evict(1) == [key(2)]


def test_touch_makes_a_block_most_recent() -> None:
    policy = Slotted(LRUPolicy(8))
    ready(policy, 1, 2, 3)
    policy.touch(key(1))
    assert policy.evict(3) == [key(2), key(3), key(1)]


def test_touch_of_unknown_or_pinned_key_changes_nothing() -> None:
    policy = Slotted(LRUPolicy(8))
    ready(policy, 1, 2)
    policy.mark_pinned(key(1))
    policy.touch(key(1))
    policy.touch(key(9))
    assert policy.evictable_count() == 1
    assert policy.evict(1) == [key(2)]


def test_unpinned_block_reenters_as_most_recent() -> None:
    policy = Slotted(LRUPolicy(8))
    ready(policy, 1, 2, 3)
    policy.mark_pinned(key(1))
    policy.mark_evictable(key(1))
    assert policy.evict(3) == [key(2), key(3), key(1)]


def test_eviction_is_atomic_when_too_few_are_evictable() -> None:
    policy = Slotted(LRUPolicy(8))
    ready(policy, 1, 2, 3)
    policy.mark_pinned(key(2))
    assert policy.evict(3) is None
    assert policy.evictable_count() == 2
    assert policy.evict(2) == [key(1), key(3)]


def test_eviction_is_atomic_when_protected_keys_leave_too_few() -> None:
    policy = Slotted(LRUPolicy(8))
    ready(policy, 1, 2, 3)
    assert policy.evict(2, {key(1), key(3)}) is None
    assert policy.evictable_count() == 3
    assert policy.evict(3) == [key(1), key(2), key(3)]


def test_protected_keys_are_never_evicted() -> None:
    policy = Slotted(LRUPolicy(8))
    ready(policy, 1, 2, 3, 4)
    assert policy.evict(2, {key(1), key(2)}) == [key(3), key(4)]
    assert policy.evict(2) == [key(1), key(2)]


def test_pinned_keys_are_never_evicted_nor_scanned() -> None:
    policy = Slotted(LRUPolicy(16))
    ready(policy, *range(10))
    for i in range(8):
        policy.mark_pinned(key(i))
    spy = ScanSpy({key(8)})
    assert policy.evict(1, spy) == [key(9)]
    assert spy.asked and set(spy.asked) <= {key(8), key(9)}
    pinned = {key(i) for i in range(8)}
    spy = ScanSpy()
    assert policy.evict(1, spy) == [key(8)]
    assert not pinned.intersection(spy.asked)


def test_in_flight_keys_are_not_scanned() -> None:
    policy = Slotted(LRUPolicy(16))
    for i in range(5):
        policy.insert(key(i))
    ready(policy, 5)
    spy = ScanSpy()
    assert policy.evict(1, spy) == [key(5)]
    assert spy.asked == [key(5)]


def test_remove_forgets_the_key() -> None:
    policy = Slotted(LRUPolicy(8))
    ready(policy, 1, 2)
    policy.remove(key(1))
    policy.remove(key(7))  # unknown keys are ignored
    assert policy.evictable_count() == 1
    assert policy.evict(2) is None
    assert policy.evict(1) == [key(2)]


def test_clear_forgets_everything() -> None:
    policy = Slotted(LRUPolicy(8))
    ready(policy, 1, 2, 3)
    policy.clear()
    assert policy.evictable_count() == 0
    assert policy.evict(1) is None


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        LRUPolicy(0)


def test_memory_per_block_stays_bounded_under_churn() -> None:
    # regression: an OrderedDict of evictable keys cost ~150 B per block in a running
    # engine, because delete/insert churn resizes a hash table to ~3x its entries.
    # Slot-indexed lists cost 8 B per slot each, however long the engine runs (25 B per
    # block here, against 75 B full and 124 B after churn for the OrderedDict).
    blocks, stores = 20_000, 100_000
    keys = [os.urandom(32) for _ in range(blocks + stores)]  # made by the engine, not counted
    slots = list(range(blocks))  # the tier's slot ints, not counted either
    gc.collect()
    tracemalloc.start()
    try:
        policy = LRUPolicy(blocks)
        for slot, k in zip(slots, keys[:blocks], strict=True):
            policy.insert(k, slot)
            policy.mark_evictable(k, slot)
        full = tracemalloc.get_traced_memory()[0] / blocks
        slot_of = dict(zip(keys[:blocks], slots, strict=True))  # the tier's index, freed before the second figure
        for i in range(blocks, blocks + stores):
            (victim,) = policy.evict(1) or ()
            slot = slot_of.pop(victim)
            k = keys[i]
            slot_of[k] = slot
            policy.insert(k, slot)
            policy.mark_evictable(k, slot)
            if i % 7 == 0:  # some hits on older blocks, which a touch moves to the tail
                older = keys[i - blocks // 2]
                if older in slot_of:
                    policy.touch(older, slot_of[older])
        del slot_of, victim, k
        gc.collect()
        steady = tracemalloc.get_traced_memory()[0] / blocks
    finally:
        tracemalloc.stop()
    assert policy.evictable_count() == blocks
    assert full <= 64, f"LRU policy costs {full:.0f} B per block when full"
    assert steady <= 64, f"LRU policy costs {steady:.0f} B per block after {stores:,} evicting stores"


class ReferenceLRU(ReferencePolicy):
    """A list of evictable keys, least recent first."""

    def __init__(self, capacity: int) -> None:
        self.order: list[BlockKey] = []

    def insert(self, k: BlockKey) -> None:
        pass

    def remove(self, k: BlockKey) -> None:
        if k in self.order:
            self.order.remove(k)

    def touch(self, k: BlockKey) -> None:
        if k in self.order:
            self.order.remove(k)
            self.order.append(k)

    def mark_evictable(self, k: BlockKey) -> None:
        if k not in self.order:
            self.order.append(k)

    def mark_pinned(self, k: BlockKey) -> None:
        self.remove(k)

    def evict(self, n: int, protected: set[BlockKey]) -> list[BlockKey] | None:
        if n <= 0:
            return []
        candidates = [k for k in self.order if k not in protected]
        if len(candidates) < n:
            return None
        chosen = candidates[:n]
        for k in chosen:
            self.order.remove(k)
        return chosen

    def clear(self) -> None:
        self.order.clear()


class LRUMachine(ProtocolMachine):
    make_policy = LRUPolicy
    make_reference = ReferenceLRU

    @invariant()
    def same_order_as_reference(self) -> None:
        assert isinstance(self.policy, LRUPolicy) and isinstance(self.ref, ReferenceLRU)
        assert linked_keys(self.tier) == self.ref.order


LRUMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestLRUAgainstReference = LRUMachine.TestCase
