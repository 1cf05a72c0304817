"""ARCPolicy: adaptive replacement over evictable blocks, with bounded ghost lists.

White-box where the contract is about internal state: ``t1``/``t2`` (resident
counts), ``_where`` (the list of the block in each slot), the slot-indexed
linked lists of evictable members (``_prev``/``_next`` through the sentinel
slots ``capacity`` for T1 and ``capacity + 1`` for T2, ``_evictable``,
``_key_of``), ``p`` (the adaptive T1 target) and the ghost lists B1/B2 (fingerprints
in ``ghosts``).
"""

from __future__ import annotations

import gc
import os
import tracemalloc
from typing import cast

import pytest
from hypothesis import settings
from hypothesis.stateful import invariant
from policy_helpers import KeyState, ProtocolMachine, ReferencePolicy, ScanSpy, Slotted, key

from kvtier.keys import BlockKey
from kvtier.policies import ARCPolicy
from kvtier.policies.arc import B1, B2
from kvtier.policies.fingerprints import fingerprint


def ghosts(policy: ARCPolicy, which: int) -> list[int]:
    """The fingerprints ghost list ``which`` (B1 or B2) remembers, least recent first."""
    return policy.ghosts.fingerprints(which)


def fps(*ids: int) -> list[int]:
    return [fingerprint(key(i)) for i in ids]


def ready(tier: Slotted[ARCPolicy], *ids: int) -> None:
    """Insert and complete keys ``ids`` in order (each enters T1, evictable)."""
    for i in ids:
        tier.insert(key(i))
        tier.mark_evictable(key(i))


def linked_slots(policy: ARCPolicy, end: int) -> list[int]:
    """The slots linked through sentinel ``end``, least recent first, after checking the links."""
    slots: list[int] = []
    slot = policy._next[end]
    while slot != end:
        assert 0 <= slot < policy.capacity, "a list runs into the other list's sentinel"
        assert len(slots) < policy.capacity, "the list has a cycle"
        assert policy._next[policy._prev[slot]] == slot
        slots.append(slot)
        slot = policy._next[slot]
    assert policy._prev[end] == (slots[-1] if slots else end)
    return slots


def evictable_keys(tier: Slotted[ARCPolicy]) -> tuple[list[BlockKey], list[BlockKey]]:
    """The evictable keys of T1 and of T2, least recent first."""
    policy = tier.policy
    c = policy.capacity
    return ([policy._key_of[s] for s in linked_slots(policy, c)],
            [policy._key_of[s] for s in linked_slots(policy, c + 1)])


def check_invariants(tier: Slotted[ARCPolicy]) -> None:
    """The class invariants stated in the module docstring of ``kvtier.policies.arc``."""
    policy = tier.policy
    where = policy._where
    assert len(where) == policy.capacity
    assert policy.t1 == where.count(1) + where.count(3)  # 3: in T1, still being written
    assert policy.t2 == where.count(2)
    assert policy.t1 + policy.t2 == len(tier.slot_of)
    assert {s for s in range(policy.capacity) if where[s]} == set(tier.slot_of.values()), "resident = listed slots"
    c = policy.capacity
    assert len(policy._prev) == len(policy._next) == c + 2
    t1e, t2e = linked_slots(policy, c), linked_slots(policy, c + 1)
    assert all(where[s] == 1 for s in t1e) and all(where[s] == 2 for s in t2e)
    assert all(not policy._evictable[s] for s in range(c) if where[s] == 3)
    assert sorted(t1e + t2e) == [s for s in range(c) if policy._evictable[s]], "linked = flagged evictable"
    assert len(t1e) + len(t2e) == policy.evictable_count()
    key_of = {s: k for k, s in tier.slot_of.items()}
    assert all(policy._key_of[s] == key_of.get(s, b"") for s in range(c)), "_key_of is stale"
    b1, b2 = ghosts(policy, B1), ghosts(policy, B2)
    assert (policy.b1, policy.b2) == (len(b1), len(b2))
    assert len(b1) + len(b2) <= policy.capacity
    assert not b1 or policy.t1 + len(b1) <= policy.capacity
    assert len(set(b1) | set(b2)) == len(b1) + len(b2), "a fingerprint is in one ghost list at most, once"
    assert all(policy.ghosts.find(fp) >= 0 for fp in b1 + b2), "every ghost is indexed"
    assert not set(b1 + b2) & {fingerprint(k) for k in tier.slot_of}, "a resident key is also a ghost"
    assert 0.0 <= policy.p <= policy.capacity


def test_new_keys_enter_t1_and_a_second_use_moves_them_to_t2() -> None:
    tier = Slotted(ARCPolicy(4))
    policy = tier.policy
    ready(tier, 1, 2)
    assert (policy.t1, policy.t2) == (2, 0)
    tier.touch(key(1))
    assert (policy.t1, policy.t2) == (1, 1)
    tier.touch(key(1))
    assert (policy.t1, policy.t2) == (1, 1)
    check_invariants(tier)


def test_touch_of_a_pinned_t1_key_moves_it_to_t2_without_making_it_evictable() -> None:
    tier = Slotted(ARCPolicy(4))
    policy = tier.policy
    ready(tier, 1)
    tier.mark_pinned(key(1))
    tier.touch(key(1))
    assert (policy.t1, policy.t2) == (0, 1)
    assert tier.evict(1) is None
    tier.mark_evictable(key(1))
    assert tier.evict(1) == [key(1)]
    assert policy.is_ghost(key(1)) == 2
    check_invariants(tier)


def test_touch_moves_an_evictable_block_to_t2s_most_recent_end() -> None:
    tier = Slotted(ARCPolicy(8))
    ready(tier, 1, 2, 3, 4)
    for i in (1, 2, 3):
        tier.touch(key(i))  # T1 -> T2, in touch order
    assert evictable_keys(tier) == ([key(4)], [key(1), key(2), key(3)])
    tier.touch(key(1))  # T2 -> T2's most recent end
    tier.touch(key(1))  # already the most recent: no change
    assert evictable_keys(tier) == ([key(4)], [key(2), key(3), key(1)])
    tier.touch(key(4))  # T1 -> T2's most recent end
    assert evictable_keys(tier) == ([], [key(2), key(3), key(1), key(4)])
    check_invariants(tier)
    assert tier.evict(4) == [key(2), key(3), key(1), key(4)]
    assert ghosts(tier.policy, B2) == fps(2, 3, 1, 4)
    check_invariants(tier)


def test_a_pinned_block_rejoins_its_list_as_most_recent() -> None:
    tier = Slotted(ARCPolicy(8))
    ready(tier, 1, 2, 3, 4, 5)
    for i in (3, 4, 5):
        tier.touch(key(i))
    tier.mark_pinned(key(1))
    tier.mark_pinned(key(3))
    tier.touch(key(3))  # pinned T2 block: stays unlinked
    assert evictable_keys(tier) == ([key(2)], [key(4), key(5)])
    assert tier.evictable_count() == 3
    tier.mark_evictable(key(3))
    tier.mark_evictable(key(1))
    assert evictable_keys(tier) == ([key(2), key(1)], [key(4), key(5), key(3)])
    check_invariants(tier)


def test_in_flight_keys_are_neither_evictable_nor_promoted_by_touch_order() -> None:
    tier = Slotted(ARCPolicy(4))
    tier.insert(key(1))
    assert tier.evictable_count() == 0
    assert tier.evict(1) is None
    tier.mark_evictable(key(1))
    assert tier.evict(1) == [key(1)]


def test_with_p_zero_t1_is_evicted_before_t2() -> None:
    tier = Slotted(ARCPolicy(8))
    policy = tier.policy
    ready(tier, 1, 2, 3)
    tier.touch(key(1))  # T2: 1; T1: 2, 3
    assert policy.p == 0.0
    assert tier.evict(2) == [key(2), key(3)]
    assert tier.evict(1) == [key(1)]


def test_frequently_used_blocks_survive_a_scan() -> None:
    tier = Slotted(ARCPolicy(8))
    policy = tier.policy
    ready(tier, 1, 2)
    tier.touch(key(1))
    tier.touch(key(2))
    for i in range(100, 140):  # a long scan of one-time blocks
        if policy.t1 + policy.t2 == 8:  # full: the tier evicts before it inserts
            evicted = tier.evict(1)
            assert evicted is not None and evicted[0] not in (key(1), key(2))
        tier.insert(key(i))
        tier.mark_evictable(key(i))
    assert policy._where[tier.slot_of[key(1)]] == 2 and policy._where[tier.slot_of[key(2)]] == 2
    check_invariants(tier)


def test_ghost_hit_in_b1_grows_p_and_in_b2_shrinks_it() -> None:
    tier = Slotted(ARCPolicy(4))
    policy = tier.policy
    ready(tier, 1, 2)
    assert tier.evict(1) == [key(1)]
    assert policy.is_ghost(key(1)) == 1
    tier.insert(key(1))  # ghost hit in B1: T1 was too small
    assert policy.p == 1.0
    assert policy._where[tier.slot_of[key(1)]] == 2, "a ghost hit re-enters in T2"
    assert not policy.is_ghost(key(1))
    tier.mark_evictable(key(1))
    tier.touch(key(2))  # T2: 1, 2 and T1 empty
    assert tier.evict(1) == [key(1)]
    assert policy.is_ghost(key(1)) == 2
    tier.insert(key(1))  # ghost hit in B2: T2 was too small
    assert policy.p == 0.0
    check_invariants(tier)


def test_ghost_hit_adaptation_scales_with_the_other_ghost_list() -> None:
    tier = Slotted(ARCPolicy(8))
    policy = tier.policy
    ready(tier, 1, 2, 3, 4)
    for i in (2, 3, 4):
        tier.touch(key(i))
    assert tier.evict(1) == [key(1)]  # B1: 1
    assert tier.evict(3) == [key(2), key(3), key(4)]  # B2: 2, 3, 4
    tier.insert(key(1))
    assert policy.p == 3.0  # |B2| / |B1| = 3
    check_invariants(tier)


def test_p_stays_within_zero_and_capacity() -> None:
    tier = Slotted(ARCPolicy(3))
    policy = tier.policy
    for round_ in range(10):
        base = 10 * round_
        ready(tier, base, base + 1, base + 2)
        assert tier.evict(3) is not None
        for i in (base, base + 1, base + 2):
            tier.insert(key(i))  # B1 ghost hits push p up
            tier.mark_evictable(key(i))
        assert tier.evict(3) is not None
        assert 0.0 <= policy.p <= 3.0
    assert policy.p == 3.0
    check_invariants(tier)


def test_a_larger_p_makes_eviction_take_from_t2() -> None:
    tier = Slotted(ARCPolicy(4))
    policy = tier.policy
    ready(tier, 1, 2, 3)
    assert tier.evict(1) == [key(1)]
    tier.insert(key(1))  # p = 1, key 1 in T2
    tier.mark_evictable(key(1))
    assert (policy.t1, policy.t2, policy.p) == (2, 1, 1.0)
    assert tier.evict(1) == [key(2)]  # t1 (2) > p (1): from T1
    assert tier.evict(1) == [key(1)]  # t1 (1) == p: from T2
    check_invariants(tier)


def test_ghost_lists_stay_bounded_by_capacity() -> None:
    tier = Slotted(ARCPolicy(3))
    policy = tier.policy
    for i in range(50):
        ready(tier, i)
        if i % 2:
            tier.touch(key(i))
        assert tier.evict(1) == [key(i)]
    # ARC's bounds: |T1| + |B1| <= c and at most c ghosts in all
    assert policy.b1 + policy.b2 == 3
    remembered = set(ghosts(policy, B1) + ghosts(policy, B2))
    assert remembered <= set(fps(*range(44, 50))), "the oldest ghosts are dropped first"
    check_invariants(tier)


def test_pinned_t1_keys_are_skipped_and_eviction_falls_back_to_t2() -> None:
    tier = Slotted(ARCPolicy(8))
    ready(tier, 1, 2, 3)
    tier.touch(key(3))  # T2: 3; T1: 1, 2 (t1 = 2 > p = 0)
    tier.mark_pinned(key(1))
    tier.mark_pinned(key(2))
    spy = ScanSpy()
    assert tier.evict(1, spy) == [key(3)]
    assert key(1) not in spy.asked and key(2) not in spy.asked
    check_invariants(tier)


def test_eviction_is_atomic_and_protected_keys_are_kept() -> None:
    tier = Slotted(ARCPolicy(8))
    policy = tier.policy
    ready(tier, 1, 2, 3)
    tier.touch(key(3))
    tier.mark_pinned(key(2))
    before = (policy.t1, policy.t2, policy.p, ghosts(policy, B1), ghosts(policy, B2))
    assert tier.evict(3) is None
    assert tier.evict(2, {key(1)}) is None
    assert (policy.t1, policy.t2, policy.p, ghosts(policy, B1), ghosts(policy, B2)) == before
    assert tier.evictable_count() == 2
    assert tier.evict(1, {key(1)}) == [key(3)]
    assert tier.evict(1) == [key(1)]
    check_invariants(tier)


def test_remove_does_not_leave_a_ghost() -> None:
    tier = Slotted(ARCPolicy(4))
    policy = tier.policy
    ready(tier, 1)
    tier.insert(key(2))
    tier.remove(key(2))  # a failed store
    tier.remove(key(1))
    assert (policy.t1, policy.t2) == (0, 0)
    assert (policy.b1, policy.b2) == (0, 0)
    check_invariants(tier)


def test_clear_resets_p_and_ghosts() -> None:
    tier = Slotted(ARCPolicy(4))
    policy = tier.policy
    ready(tier, 1, 2)
    tier.evict(1)
    tier.insert(key(1))
    assert policy.p > 0
    tier.clear()
    assert (policy.t1, policy.t2, policy.p, tier.evictable_count()) == (0, 0, 0.0, 0)
    assert (policy.b1, policy.b2) == (0, 0)


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ARCPolicy(-1)


def test_memory_per_block_stays_bounded_under_churn() -> None:
    # regression: OrderedDicts of the evictable keys of T1/T2 cost ~150 B per block in a
    # running engine, because delete/insert churn resizes a hash table to ~3x its entries,
    # and OrderedDict ghost lists cost ~155 B per remembered key (371-406 B per block in all
    # when B1 + B2 were full). The slot-indexed lists cost 8 B per slot each and the ghosts
    # are fingerprints in arrays allocated once, however long the engine runs.
    blocks, stores = 20_000, 100_000
    keys = [os.urandom(32) for _ in range(blocks + stores)]  # made by the engine, not counted
    slots = list(range(blocks))  # the tier's slot ints, not counted either
    gc.collect()
    tracemalloc.start()
    try:
        policy = ARCPolicy(blocks)
        for slot, k in zip(slots, keys[:blocks], strict=True):
            policy.insert(k, slot)
            policy.mark_evictable(k, slot)
        full = tracemalloc.get_traced_memory()[0] / blocks
        slot_of = dict(zip(keys[:blocks], slots, strict=True))  # the tier's index, freed before the next figure
        for i in range(blocks, blocks + stores):
            (victim,) = policy.evict(1) or ()
            slot = slot_of.pop(victim)
            k = keys[i]
            slot_of[k] = slot
            policy.insert(k, slot)
            policy.mark_evictable(k, slot)
            if i % 4:  # three in four blocks are used again: T2 fills up, and so does B2
                policy.touch(k, slot)
        del slot_of, victim, k
        gc.collect()
        steady = tracemalloc.get_traced_memory()[0] / blocks
    finally:
        tracemalloc.stop()
    t1, t2, b1, b2 = policy.t1, policy.t2, policy.b1, policy.b2
    assert policy.evictable_count() == blocks
    assert t2 > t1 and b2 > 0 and b1 + b2 == blocks, f"T1 {t1}, T2 {t2}, B1 {b1}, B2 {b2}"
    assert full <= 64, f"ARC policy costs {full:.0f} B per block when full (ghost table included)"
    assert steady <= full + 2, f"ARC grew from {full:.0f} to {steady:.0f} B per block with full ghost lists"


class ReferenceARC(ReferencePolicy):
    """ARC with plain lists: T1/T2 hold every resident key (least recent first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p = 0.0
        self.t1: list[BlockKey] = []
        self.t2: list[BlockKey] = []
        self.b1: list[BlockKey] = []
        self.b2: list[BlockKey] = []
        self.evictable: set[BlockKey] = set()

    def trim(self) -> None:
        """ARC's directory bounds: |T1| + |B1| <= c, and at most c ghosts in all."""
        while self.b1 and len(self.t1) + len(self.b1) > self.capacity:
            self.b1.pop(0)
        while self.b2 and len(self.b1) + len(self.b2) > self.capacity:
            self.b2.pop(0)

    def insert(self, k: BlockKey) -> None:
        if k in self.b1:
            self.p = min(float(self.capacity), self.p + max(len(self.b2) / len(self.b1), 1.0))
            self.b1.remove(k)
            self.t2.append(k)
        elif k in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            self.b2.remove(k)
            self.t2.append(k)
        else:
            self.t1.append(k)
            self.trim()

    def remove(self, k: BlockKey) -> None:
        for lst in (self.t1, self.t2):
            if k in lst:
                lst.remove(k)
        self.evictable.discard(k)

    def touch(self, k: BlockKey) -> None:
        if k in self.t1:
            self.t1.remove(k)
            self.t2.append(k)
        elif k in self.t2:
            self.t2.remove(k)
            self.t2.append(k)

    def mark_evictable(self, k: BlockKey) -> None:
        self.evictable.add(k)
        self.touch_in_place(k)

    def touch_in_place(self, k: BlockKey) -> None:
        """Becoming evictable makes a key most recent within its own list."""
        for lst in (self.t1, self.t2):
            if k in lst:
                lst.remove(k)
                lst.append(k)

    def mark_pinned(self, k: BlockKey) -> None:
        self.evictable.discard(k)

    def evict(self, n: int, protected: set[BlockKey]) -> list[BlockKey] | None:
        if n <= 0:
            return []
        cand1 = [k for k in self.t1 if k in self.evictable and k not in protected]
        cand2 = [k for k in self.t2 if k in self.evictable and k not in protected]
        t1 = len(self.t1)
        chosen: list[BlockKey] = []
        while len(chosen) < n:
            if cand1 and (t1 > self.p or not cand2):
                chosen.append(cand1.pop(0))
                t1 -= 1
            elif cand2:
                chosen.append(cand2.pop(0))
            else:
                return None
        for k in chosen:
            ghosts = self.b1 if k in self.t1 else self.b2
            self.remove(k)
            ghosts.append(k)
        self.trim()
        return chosen

    def clear(self) -> None:
        self.__init__(self.capacity)  # type: ignore[misc]


class ARCMachine(ProtocolMachine):
    make_policy = ARCPolicy
    make_reference = ReferenceARC

    @invariant()
    def same_lists_as_reference(self) -> None:
        policy = self.policy
        assert isinstance(policy, ARCPolicy) and isinstance(self.ref, ReferenceARC)
        check_invariants(cast("Slotted[ARCPolicy]", self.tier))
        assert policy.p == self.ref.p
        assert (policy.t1, policy.t2) == (len(self.ref.t1), len(self.ref.t2))
        assert ghosts(policy, B1) == [fingerprint(k) for k in self.ref.b1]
        assert ghosts(policy, B2) == [fingerprint(k) for k in self.ref.b2]
        resident = {k for k, s in self.state.items() if s is not KeyState.ABSENT}
        assert set(self.tier.slot_of) == resident
        assert {s for s in range(policy.capacity) if policy._where[s]} == {self.tier.slot_of[k] for k in resident}
        ref_t1e = [k for k in self.ref.t1 if k in self.ref.evictable]
        ref_t2e = [k for k in self.ref.t2 if k in self.ref.evictable]
        assert evictable_keys(cast("Slotted[ARCPolicy]", self.tier)) == (ref_t1e, ref_t2e), "list order"


ARCMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestARCAgainstReference = ARCMachine.TestCase
