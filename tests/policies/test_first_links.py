"""Blocks to evict first (an ended conversation's, expiry FIRST) joining the lists when they become
evictable: found by a review of the change that brought them (2026-12-06), each reproduced first."""

from __future__ import annotations

from policy_helpers import Slotted, key
from test_return_time import check_invariants, evict_all, ready, store

from kvtier.policies import ReturnTimePolicy
from kvtier.policies.return_time import CLASSES


def test_a_stale_parent_cycle_of_blocks_to_evict_first_stays_linked() -> None:
    # Regression: B orphaned (its parent A evicted while B was pinned), C given A's old slot and
    # stored under B: par[B] = C, par[C] = B. Released in one call after the conversation ended,
    # B and C were flagged evictable but linked into no list: never evicted again.
    t = Slotted(ReturnTimePolicy(4))
    p = t.policy
    store(t, [1])
    store(t, [2], parent=1)
    t.mark_pinned(key(2))
    assert t.evict(1) == [key(1)]
    for i in (3, 4):
        t.insert(key(i))
    assert p._parent[t.slot_of[key(2)]] == t.slot_of[key(3)]  # the stale link, now a cycle
    t.reference_chain([key(3), key(4)], key(2), hit=False)
    ready(t, [3, 4])
    p.end_request(t.slot_of[key(4)])
    t.mark_pinned(key(3))
    p.hint_request(t.slot_of[key(4)], "a", True, None)
    p.mark_evictable_many([key(2), key(3)], [t.slot_of[key(2)], t.slot_of[key(3)]])
    check_invariants(t)
    assert p.evictable_count() == 3
    assert sorted(t.evict(3)) == sorted([key(2), key(3), key(4)])


def test_a_held_block_under_a_parent_to_evict_first_keeps_its_hold() -> None:
    # Regression: released alone, a held block whose parent is to go first was put in the expired
    # list when its wheel list had the index FIRST's bucket arithmetic gives (holds of 249 here):
    # evicted while held, before a block that expired earlier.
    t = Slotted(ReturnTimePolicy(64))
    p = t.policy
    p.classes.hold = [249] * CLASSES
    store(t, [50])  # someone else's block: expires before the conversation's
    store(t, [10, 11, 12])
    p.hint_request(t.slot_of[key(12)], "a", False, None)
    store(t, [13, 14], parent=11)  # turn 2, after turn 1's body; 12 branches off 11
    t.mark_pinned(key(12))
    p.hint_request(t.slot_of[key(14)], "a", True, None)  # 14, 13, 11, 10 go first; 12 keeps its hold
    p.mark_evictable_many([key(12)], [t.slot_of[key(12)]])
    check_invariants(t)
    order = evict_all(t)
    assert order.index(50) < order.index(12), order
    assert order[:2] == [14, 13], order
