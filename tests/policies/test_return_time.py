"""ReturnTimePolicy: prefix-closed eviction by learned holding times.

White-box where the contract is about internal state: the timing wheel of
slot lists (``_prev``/``_next``: the expired list through sentinel
``capacity``, wheel list ``r`` through ``capacity + 1 + r``), ``_evictable``,
``_key_of``, the prefix links ``_parent``/``_children``, ``_expiry`` and the
learned ``hold`` per class.
"""

from __future__ import annotations

import gc
import itertools
import os
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from policy_helpers import ScanSpy, Slotted, key

from kvtier.keys import BlockKey
from kvtier.policies import LRUPolicy, ReturnTimePolicy
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.fingerprints import fingerprint
from kvtier.policies.return_time import CLASSES, NEW_BUCKETS, RING, class_id
from kvtier.policies.return_time.classes import BASE_OF_NEW, LAST
from kvtier.policies.return_time.wheel import CLOCK, MARK, OPEN
from kvtier.policies.slot_lists import NO_KEY


def store(tier: Slotted[ReturnTimePolicy], ids: list[int], parent: int | None = None, end: bool = True) -> None:
    """A request stores the new blocks ``ids`` (in prefix order) after ``parent``; they become ready;
    the request ends unless ``end`` is False (it may store more: :func:`store_more`)."""
    for i in ids:
        tier.insert(key(i))
    tier.reference_chain([key(i) for i in ids], None if parent is None else key(parent), hit=False)
    ready(tier, ids)
    if end:
        tier.policy.end_request(tier.slot_of[key(ids[-1])])


def ready(tier: Slotted[ReturnTimePolicy], ids: list[int]) -> None:
    """The blocks ``ids`` become evictable as the CPU tier completes a store: in one call, tail first."""
    tail_first = [key(i) for i in reversed(ids)]
    tier.policy.mark_evictable_many(tail_first, [tier.slot_of[k] for k in tail_first])


def store_more(tier: Slotted[ReturnTimePolicy], ids: list[int], parent: int) -> None:
    """The same request stores the next new blocks ``ids`` after its last store, which ended in ``parent``
    (the request goes on: :func:`end` ends it)."""
    for i in ids:
        tier.insert(key(i))
    tier.policy.continue_chain([key(i) for i in ids], [tier.slot_of[key(i)] for i in ids], tier.slot_of[key(parent)])
    ready(tier, ids)


def end(tier: Slotted[ReturnTimePolicy], tail: int) -> None:
    """The request whose last store ended with block ``tail`` finished."""
    tier.policy.end_request(tier.slot_of[key(tail)])


def load(tier: Slotted[ReturnTimePolicy], ids: list[int], parent: int | None = None) -> None:
    """A request is served the ready blocks ``ids`` (a hit prefix)."""
    tier.reference_chain([key(i) for i in ids], None if parent is None else key(parent), hit=True)


def linked(policy: ReturnTimePolicy) -> list[list[int]]:
    """Slots of the expired list and of each wheel list (oldest bucket first), after checking links."""
    c = policy.capacity
    lists: list[list[int]] = []
    for end in [c] + [c + 1 + b % RING for b in range(policy._cur, policy._cur + RING)]:
        slots: list[int] = []
        slot = policy._next[end]
        while slot != end:
            assert 0 <= slot < c, "a list runs into a sentinel"
            assert len(slots) < c, "a list has a cycle"
            assert policy._next[policy._prev[slot]] == slot
            slots.append(slot)
            slot = policy._next[slot]
        assert policy._prev[end] == (slots[-1] if slots else end)
        lists.append(slots)
    return lists


def check_invariants(tier: Slotted[ReturnTimePolicy]) -> None:
    """The invariants stated in ``kvtier.policies.return_time``'s docstrings."""
    policy = tier.policy
    c = policy.capacity
    lists = linked(policy)
    everything = [s for lst in lists for s in lst]
    assert sorted(everything) == [s for s in range(c) if policy._evictable[s]], "linked = flagged evictable"
    assert len(everything) == policy.evictable_count()
    width = policy._width
    for r, lst in enumerate(lists[1:]):
        bucket = policy._cur + r
        assert all(
            (policy._expiry[s] & CLOCK) // width == bucket
            for s in lst
        ), f"wheel list {r} holds another bucket"
    key_of = {s: k for k, s in tier.slot_of.items()}
    assert all(policy._key_of[s] == key_of.get(s, NO_KEY) for s in range(c)), "_key_of is stale"
    resident = set(tier.slot_of.values())
    counts = [0] * c
    for s in resident:
        up = policy._parent[s]
        if up >= 0:
            counts[up] += 1
    assert [c % MARK for c in policy._children] == counts, "_children counts the held blocks naming each slot"
    assert all(policy._parent[s] == -1 for s in range(c) if s not in resident), "a free slot has no parent"


def evict_all(tier: Slotted[ReturnTimePolicy]) -> list[int]:
    out = []
    while tier.evictable_count():
        (k,) = tier.evict(1) or ()
        out.append(int.from_bytes(k, "big"))
    return out


def test_without_learning_the_order_is_lru_with_the_head_last() -> None:
    tier = Slotted(ReturnTimePolicy(16))
    store(tier, [1, 2, 3])
    store(tier, [4, 5])
    check_invariants(tier)
    assert evict_all(tier) == [3, 2, 1, 5, 4]


def test_a_loaded_prefix_outlives_the_tail_its_request_stored() -> None:
    tier = Slotted(ReturnTimePolicy(16))
    store(tier, [1, 2, 3])
    store(tier, [9])
    load(tier, [1, 2])  # the next turn hits 1, 2 ...
    store(tier, [6, 7], parent=2)  # ... and stores 6, 7 after them (3 was the old partial block)
    check_invariants(tier)
    # LRU would take 3, 9, 2, 1: the head of the live chain, leaving 6 and 7 unreachable.
    assert tier.evict(4) == [key(3), key(9), key(7), key(6)]
    check_invariants(tier)
    assert evict_all(tier) == [2, 1]


def test_a_parent_with_a_pinned_child_goes_only_when_nothing_else_can() -> None:
    tier = Slotted(ReturnTimePolicy(16))
    store(tier, [1, 2, 3])
    store(tier, [8])
    tier.mark_pinned(key(3))
    assert tier.evict(1) == [key(8)], "the chain 1-2 waits for its pinned child"
    assert tier.evict(1) == [key(2)], "then it goes (its child is orphaned), deepest first"
    check_invariants(tier)
    assert tier.policy._children[tier.slot_of[key(1)]] == 0
    tier.mark_evictable(key(3))
    assert tier.policy._parent[tier.slot_of[key(3)]] >= 0, "the orphan still counts in its parent slot"
    check_invariants(tier)
    assert evict_all(tier) == [1, 3] or evict_all(tier) == []


def test_an_orphan_is_counted_in_the_reused_slot_until_it_leaves() -> None:
    tier = Slotted(ReturnTimePolicy(4))
    store(tier, [1, 2])
    tier.mark_pinned(key(2))
    assert tier.evict(1) == [key(1)]  # forced: its child 2 is pinned
    store(tier, [5])  # 5 takes 1's old slot, which 2 still names as parent
    store(tier, [6])
    assert tier.slot_of[key(5)] == tier.policy._parent[tier.slot_of[key(2)]]
    check_invariants(tier)
    assert tier.evict(1) == [key(6)], "5 counts the orphan 2 as a child: a leaf goes first"
    tier.mark_evictable(key(2))
    assert tier.evict(2) == [key(2), key(5)], "the orphan leaves, then 5 is a leaf"
    check_invariants(tier)


def test_a_store_relinks_a_held_block_under_its_new_parent() -> None:
    tier = Slotted(ReturnTimePolicy(8))
    store(tier, [1, 2])
    store(tier, [3])
    tier.insert(key(4))
    tier.reference_chain([key(4), key(2)], hit=False)  # the request says 2 follows 4
    tier.mark_evictable(key(4))
    check_invariants(tier)
    assert tier.policy._parent[tier.slot_of[key(2)]] == tier.slot_of[key(4)]


def test_protected_keys_are_kept_and_eviction_is_atomic() -> None:
    tier = Slotted(ReturnTimePolicy(8))
    store(tier, [1])
    store(tier, [2])
    store(tier, [3])
    tier.mark_pinned(key(2))
    assert tier.evict(3) is None
    assert tier.evict(2, {key(1)}) is None
    assert tier.evictable_count() == 2
    check_invariants(tier)
    assert tier.evict(1, {key(1)}) == [key(3)]
    assert tier.evict(1) == [key(1)]


def test_pinned_and_in_flight_blocks_are_never_scanned() -> None:
    tier = Slotted(ReturnTimePolicy(32))
    for i in range(10):
        store(tier, [i])
    for i in range(8):
        tier.mark_pinned(key(i))
    tier.insert(key(20))  # in flight
    tier.reference_chain([key(20)], hit=False)
    spy = ScanSpy({key(8)})
    assert tier.evict(1, spy) == [key(9)]
    assert set(spy.asked) <= {key(8), key(9)}


def test_a_long_chain_stored_piece_by_piece_is_evicted_from_its_tail_with_bounded_scans() -> None:
    tier = Slotted(ReturnTimePolicy(4096))
    prev = None
    for start in range(0, 4000, 16):  # one request's 4000 blocks, stored 16 at a time
        ids = list(range(start, start + 16))
        store(tier, ids, parent=prev)
        prev = ids[-1]
    spy = ScanSpy()
    chosen = tier.evict(16, spy)
    assert chosen == [key(i) for i in range(3999, 3983, -1)], "the last piece goes, tail first"
    assert len(spy.asked) == 16
    assert len(tier.policy._next) == 4096 + 1 + RING
    check_invariants(tier)


@pytest.mark.parametrize("learned", [False, True])
def test_a_request_stored_a_block_at_a_time_stays_tail_first(learned: bool) -> None:
    # Regression: each piece was linked at its list's tail, behind its parent, so the list
    # held the request head first; every eviction passed _PASS_LIMIT ancestors (about 2x a
    # decode store's cost) and then took the oldest of them, cutting the prefix at its head.
    # With learned holds the request's blocks move when it is settled, which must keep the
    # order too.
    tier = Slotted(ReturnTimePolicy(1024))
    if learned:
        tier.policy.classes.hold = list(range(10, 10 + CLASSES))  # every class its own hold
    store(tier, [0, 1, 2, 3], end=False)  # the prefill
    for i in range(4, 12):  # then one decoded block per store
        store_more(tier, [i], i - 1)
    tail_first = [tier.slot_of[key(i)] for i in range(11, -1, -1)]
    assert [s for lst in linked(tier.policy) for s in lst] == tail_first
    check_invariants(tier)
    end(tier, 11)
    assert [s for lst in linked(tier.policy) for s in lst] == tail_first
    check_invariants(tier)
    for expected in range(11, 5, -1):
        spy = ScanSpy()
        assert tier.evict(1, spy) == [key(expected)]
        assert spy.asked == [key(expected)], "nothing passed over"
    check_invariants(tier)


def test_a_release_given_head_first_links_the_chain_tail_first() -> None:
    # The CPU tier completes a store tail first but releases a cascaded store's pins in the
    # cascade's (prefix) order; either way eviction must meet the leaf first.
    tier = Slotted(ReturnTimePolicy(64))
    ids = list(range(8))
    for i in ids:
        tier.insert(key(i))
    tier.reference_chain([key(i) for i in ids], hit=False)
    slots = [tier.slot_of[key(i)] for i in ids]
    tier.policy.mark_evictable_then_pinned_many([key(i) for i in reversed(ids)], slots[::-1])
    assert tier.evictable_count() == 0
    tier.policy.mark_evictable_many([key(i) for i in ids], slots)  # head first
    assert [s for lst in linked(tier.policy) for s in lst] == slots[::-1]
    check_invariants(tier)
    spy = ScanSpy()
    assert tier.evict(1, spy) == [key(7)] and spy.asked == [key(7)]


def test_holds_keep_the_head_at_least_as_long_as_the_tail_and_raise_ancestors() -> None:
    tier = Slotted(ReturnTimePolicy(64))
    policy = tier.policy
    policy.classes.hold = [policy.max_hold // 2 + c for c in range(CLASSES)]  # as if learned: every class held
    store(tier, [1, 2, 3])
    expiry = [policy._expiry[tier.slot_of[key(i)]] for i in (1, 2, 3)]
    assert expiry[0] >= expiry[1] >= expiry[2] > policy._now - 3
    store(tier, [4])  # unrelated, pushes the clock on
    policy.classes.hold = [policy.max_hold] * CLASSES
    store(tier, [5], parent=3)  # a long hold for the extension raises the whole chain
    new = policy._expiry[tier.slot_of[key(5)]]
    assert all(policy._expiry[tier.slot_of[key(i)]] >= new for i in (1, 2, 3))
    check_invariants(tier)
    assert evict_all(tier) == [4, 5, 3, 2, 1]


def test_a_request_stored_in_pieces_is_classified_as_one_request_when_it_ends() -> None:
    whole, pieces = Slotted(ReturnTimePolicy(64)), Slotted(ReturnTimePolicy(64))
    for tier in (whole, pieces):
        tier.policy.classes.hold = [policy_hold for policy_hold in range(10, 10 + CLASSES)]  # every class its own hold
    store(whole, list(range(1, 11)))
    store(pieces, [1], end=False)
    store_more(pieces, [2, 3], parent=1)
    store_more(pieces, [4, 5, 6, 7, 8, 9, 10], parent=3)
    assert sum(pieces.policy.classes.refs) == 0, "not classified while it may go on"
    deadline = pieces.policy._expiry[pieces.slot_of[key(1)]]
    assert all(pieces.policy._expiry[pieces.slot_of[key(i)]] == deadline for i in range(1, 11))
    assert deadline >= pieces.policy.max_hold, "open: held as long as any block"
    # One recorded end for the request, however many stores: its first store's (key 1) while
    # it goes on, its last full block (key 9) once it ends.
    assert len(pieces.policy.classes.history) == len(whole.policy.classes.history) == 1
    assert whole.policy.classes.history.deepest([key(i) for i in range(1, 11)], 0) == 8
    assert pieces.policy.classes.history.deepest([key(i) for i in range(1, 11)], 0) == 0
    end(pieces, 10)
    # One request of 10 new blocks: nine in the last bucket, the tenth its last block, both ways.
    assert pieces.policy.classes.refs == whole.policy.classes.refs
    last_bucket = (NEW_BUCKETS - 1) * 6
    assert whole.policy.classes.refs[last_bucket] == 9 and whole.policy.classes.refs[last_bucket + 3] == 1
    assert len(pieces.policy.classes.history) == 1
    assert pieces.policy.classes.history.deepest([key(i) for i in range(1, 11)], 0) == 8
    assert not pieces.policy._open and not pieces.policy._open_old, "the finished request's record went"
    for tier in (whole, pieces):
        expiry = [tier.policy._expiry[tier.slot_of[key(i)]] for i in range(1, 11)]
        assert expiry == sorted(expiry, reverse=True), "the head never expires before the tail"
        check_invariants(tier)
    assert [pieces.policy._expiry[pieces.slot_of[key(i)]] for i in range(1, 11)] == [
        whole.policy._expiry[whole.slot_of[key(i)]] + 3 for i in range(1, 11)
    ], "the same holds, from the last store (3 references later than the whole store)"
    assert evict_all(pieces) == list(range(10, 0, -1))


def test_no_block_is_evicted_by_a_later_store_of_its_own_request() -> None:
    # Regression (issue 21): a request's first piece was classified alone, as a request of
    # one new block whose last block it is, the class held 0; the next piece's reservation
    # evicted it before the policy heard that the store continued the request.
    tier = Slotted(ReturnTimePolicy(16))
    policy = tier.policy
    policy.classes.hold = [policy.max_hold] * CLASSES
    policy.classes.hold[class_id(0, True, 0)] = 0  # a lone last block: not held
    for r in range(8):  # other requests, two blocks each, filling the tier: held
        store(tier, [100 + 2 * r, 101 + 2 * r])
    own: list[int] = []
    for i in range(8):  # a prefill of one block, then decode stores of one block
        if not tier.free:
            (victim,) = tier.evict(1) or ()
            assert int.from_bytes(victim, "big") not in own, f"a block of {own} evicted for its own request"
        if own:
            store_more(tier, [i], own[-1])
        else:
            store(tier, [i], end=False)
        own.append(i)
    end(tier, 7)
    check_invariants(tier)


def test_an_unfinished_request_publishes_its_end_when_its_record_goes() -> None:
    # The engine may never say a request ended: the request is still settled (its blocks no
    # longer open) and its end reaches the table, when the record is dropped (a generation
    # of records full), taken by a store that is not the request's continuation, or by clear().
    tier = Slotted(ReturnTimePolicy(1024))
    policy = tier.policy
    store(tier, [1, 2], end=False)
    store_more(tier, [3, 4], parent=2)
    assert policy.classes.history.deepest([key(3)], 0) == -1, "the end moves when the request ends"
    policy.clear()
    assert policy.classes.history.deepest([key(3)], 0) == 0, "clear() published it"

    tier = Slotted(ReturnTimePolicy(1024))
    policy = tier.policy
    store(tier, [1, 2], end=False)
    store_more(tier, [3, 4], parent=2)
    ids = iter(range(100, 10_000))
    while tier.slot_of[key(4)] in {**policy._open, **policy._open_old}:  # other requests, until the record goes
        store(tier, [next(ids)], end=False)
    assert policy.classes.history.deepest([key(3)], 0) == 0
    assert all(policy._expiry[tier.slot_of[key(i)]] < OPEN for i in (1, 2, 3, 4)), "settled"

    tier = Slotted(ReturnTimePolicy(1024))
    policy = tier.policy
    store(tier, [1, 2], end=False)
    store_more(tier, [3, 4], parent=2)
    policy.continue_chain([key(3)], [tier.slot_of[key(3)]], tier.slot_of[key(4)])  # not new blocks
    assert policy.classes.history.deepest([key(3)], 0) == 0, "a store that does not continue it took the record"
    assert all(policy._expiry[tier.slot_of[key(i)]] < OPEN for i in (1, 2, 3, 4)), "settled"


def test_a_continuation_of_an_unknown_request_is_a_store_of_its_own() -> None:
    alone, continued = Slotted(ReturnTimePolicy(64)), Slotted(ReturnTimePolicy(64))
    for tier in (alone, continued):
        store(tier, [1, 2])  # it ended: its record is gone
    store(alone, [3], parent=2)
    store_more(continued, [3], parent=2)
    end(continued, 3)
    assert continued.policy.classes.refs == alone.policy.classes.refs
    assert len(continued.policy.classes.history) == len(alone.policy.classes.history) == 2, "an end of its own"
    check_invariants(continued)


def test_the_clock_splices_expired_lists_in_expiry_order() -> None:
    tier = Slotted(ReturnTimePolicy(64))
    policy = tier.policy
    policy.classes.hold = [0] * CLASSES
    policy.classes.hold[3] = 3 * policy._width  # the last block of a store with one new block
    store(tier, [1])  # held 3 buckets
    store(tier, [2, 3])  # two new blocks: other classes, not held
    for i in range(10, 10 + 2 * policy._width, 4):  # a few buckets of traffic
        store(tier, [i, i + 1, i + 2, i + 3])
        check_invariants(tier)
    order = evict_all(tier)
    assert order.index(2) < order.index(1), "1's hold outlasted 2's"


def test_touch_and_remove_of_a_free_slot_are_ignored() -> None:
    tier = Slotted(ReturnTimePolicy(8))
    store(tier, [1])
    before = list(tier.policy._expiry)
    tier.touch(key(5))
    tier.remove(key(5))
    assert list(tier.policy._expiry) == before
    check_invariants(tier)


def test_remove_unlinks_a_block_from_its_parent() -> None:
    tier = Slotted(ReturnTimePolicy(8))
    store(tier, [1, 2])
    tier.remove(key(2))
    check_invariants(tier)
    assert tier.policy._children[tier.slot_of[key(1)]] == 0
    assert tier.evict(1) == [key(1)]


def test_clear_forgets_blocks_but_keeps_what_was_learned() -> None:
    tier = Slotted(ReturnTimePolicy(64))
    run_workload(tier.policy, returning_conversations(seed=1, requests=1500))
    learned = list(tier.policy.classes.hold)
    tier.policy.clear()
    assert tier.policy.evictable_count() == 0 and tier.policy.evict(1) is None
    assert tier.policy.classes.hold == learned
    assert all(p == -1 for p in tier.policy._parent) and not any(tier.policy._children)


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ReturnTimePolicy(0)


# --- learning --------------------------------------------------------------------------


Request = list[int]


def returning_conversations(seed: int, requests: int, conversations: int = 8) -> list[Request]:
    """Short multi-turn conversations that come back after long pauses, among one-shot scans.

    Each turn re-sends the conversation (a few blocks) plus one new block; a
    conversation ends after five turns and a new one takes its place. Half the
    requests are scans of 24 blocks never seen again, so between two turns of a
    conversation about 16 requests push some 200 blocks through a cache of 64:
    LRU keeps almost none of them, while the conversations alone fit.
    """
    rng = random.Random(seed)
    next_id = 1
    history: list[list[int]] = []
    turns: list[int] = []
    for _ in range(conversations):
        history.append([0, next_id])
        turns.append(0)
        next_id += 1
    out: list[Request] = []
    while len(out) < requests:
        if rng.random() < 0.5:
            c = rng.randrange(conversations)
            if turns[c] == 5:
                history[c], turns[c] = [0], 0
            history[c] = history[c] + [next_id]
            turns[c] += 1
            next_id += 1
            out.append(list(history[c]))
        else:
            out.append([0, *range(next_id, next_id + 24)])
            next_id += 24
    return out


def run_workload(policy: EvictionPolicy, requests: list[Request]) -> float:
    """Prefix-hit rate of ``requests`` through ``policy``, driven the way the CPU tier drives it."""
    tier: Slotted[EvictionPolicy] = Slotted(policy)
    hits = refs = 0
    for req in requests:
        keys = [key(i) for i in req]
        h = 0
        while h < len(keys) and keys[h] in tier.slot_of:
            h += 1
        hits += h
        refs += len(keys)
        if h:
            tier.reference_chain(keys[:h], hit=True)
        new = [k for k in keys[h:] if k not in tier.slot_of]
        shortfall = len(new) - len(tier.free)
        if shortfall > 0 and tier.evict(shortfall, set(keys)) is None:
            continue
        for k in new:
            tier.insert(k)
        if keys[h:]:
            tier.reference_chain(keys[h:], keys[h - 1] if h else None, hit=False)
        for k in reversed(new):
            tier.mark_evictable(k)
        if keys[h:]:
            policy.end_request(tier.slot_of[keys[-1]])
    return hits / refs


def test_learned_holds_keep_returning_conversations_through_scans() -> None:
    requests = returning_conversations(seed=3, requests=6000)
    lru = run_workload(LRUPolicy(64), requests)
    policy = ReturnTimePolicy(64)
    learned = run_workload(policy, requests)
    assert policy.learning and policy.fallbacks == 0
    assert learned >= 1.2 * lru, f"learned {learned:.3f} vs LRU {lru:.3f}"
    # The scans' blocks (many new blocks, never back) are hardly held; conversation blocks are:
    # a turn's new block (one new block, the last) and the blocks it hits (referenced before).
    scan, turn_end, prefix = (NEW_BUCKETS - 1) * 6, 0 * 6 + 3, 0 * 6 + 1
    assert policy.classes.hold[scan] * 4 < min(policy.classes.hold[turn_end], policy.classes.hold[prefix])


def test_the_guard_returns_to_lru_order_at_once_when_learning_loses() -> None:
    tier = Slotted(ReturnTimePolicy(64))
    policy = tier.policy
    run_workload(policy, returning_conversations(seed=4, requests=3000))
    assert policy.learning
    store(tier, [7_000_001])
    assert policy._evictable[tier.slot_of[key(7_000_001)]]
    now = policy._now
    policy.guard._lead, policy.guard._spread = -50.0, 100.0  # the miniatures say the learned holds lose
    policy.guard._period = [-20, 40]
    policy._next_solve = now
    store(tier, [7_000_002])  # the next reference solves and judges
    assert not policy.learning and policy.fallbacks == 1
    assert policy.classes.hold == [0] * CLASSES
    assert max(policy._expiry) <= policy._now, "every hold ended at once"
    assert all(not lst for lst in linked(policy)[2:]), "the wheel is empty: all of it is in LRU order"


def test_replays_are_identical_under_any_hash_seed() -> None:
    # Sampling reads key bytes, never Python's per-process hash: results must not depend on it.
    here = str(Path(__file__).parent)
    script = (
        f"import sys; sys.path.insert(0, {here!r})\n"
        "from test_return_time import returning_conversations, run_workload\n"
        "from kvtier.policies import ReturnTimePolicy\n"
        "print(run_workload(ReturnTimePolicy(64), returning_conversations(seed=5, requests=2500)))\n"
    )
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        outs.add(done.stdout.strip())
    assert len(outs) == 1, outs


def policy_bytes() -> int:
    """Traced bytes allocated by kvtier's policies package (the tier's index and keys excluded)."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*kvtier/policies/*")])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def test_memory_per_block_stays_bounded_under_churn() -> None:
    blocks, stores = 20_000, 40_000
    keys = [os.urandom(32) for _ in range(blocks + 2 * stores)]  # made by the engine, not counted
    slots = list(range(blocks))  # the tier's slot ints, not counted either
    slot_of = dict(zip(keys[:blocks], slots, strict=True))
    tracemalloc.start()
    try:
        policy = ReturnTimePolicy(blocks)
        empty = policy_bytes()
        for slot, k in zip(slots, keys[:blocks], strict=True):
            policy.insert(k, slot)
            policy.reference_chain((k,), (slot,), -1, False)
            policy.mark_evictable(k, slot)
        figures = []
        for start in (blocks, blocks + stores):
            for i in range(start, start + stores, 8):
                chain = keys[i : i + 8]
                victims = policy.evict(len(chain)) or []
                chain_slots = [slot_of.pop(v) for v in victims]
                for k, slot in zip(chain, chain_slots, strict=True):
                    slot_of[k] = slot
                    policy.insert(k, slot)
                policy.reference_chain(chain, chain_slots, -1, False)
                for k, slot in zip(chain, chain_slots, strict=True):
                    policy.mark_evictable(k, slot)
            figures.append(policy_bytes())
    finally:
        tracemalloc.stop()
    assert policy.evictable_count() == blocks
    # Per slot: two list pointers and the key (24 B) and 18 B of arrays; the sample tables
    # (at small capacities 2 x capacity fingerprints of about 39 B) are allocated once.
    assert empty / blocks <= 150, f"{empty / blocks:.0f} B per block allocated up front"
    # Running adds little: the table of request ends is allocated up front too.
    assert figures[0] - empty <= 12 * blocks, f"running grew the policy by {(figures[0] - empty) / blocks:.1f} B/block"
    assert figures[1] - figures[0] <= blocks, "churn keeps growing the policy"


def test_large_tiers_preallocate_at_most_64_bytes_per_block() -> None:
    # The policy's budget (issue 14: about 64 extra bytes per block). Slot state (a pointer per
    # list, the key, parent and child count: 40 B; 9 B of arrays), a sample of an eighth of the
    # capacity (about 39 B per entry): 54 B per block, and the recorded ends of a quarter of the
    # capacity in requests (24 B per entry, the index a quarter full): 6 B per block. 61 B today.
    blocks = 1 << 20
    gc.collect()
    tracemalloc.start()
    try:
        policy = ReturnTimePolicy(blocks)
        allocated = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert policy.sampler.size == blocks // 8
    assert policy.classes.history.capacity == blocks // 4
    assert allocated / blocks <= 64, f"{allocated / blocks:.1f} B per block"


# --- random interleavings ----------------------------------------------------------------


class StructureMachine(RuleBasedStateMachine):
    """The tier's calls in random order, with chains, checking the structural invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.tier: Slotted[ReturnTimePolicy] = Slotted(ReturnTimePolicy(6))
        self.ready: set[BlockKey] = set()
        self.pinned: set[BlockKey] = set()
        self.writing: set[BlockKey] = set()

    ids = st.integers(0, 11)

    @rule(chain=st.lists(ids, min_size=1, max_size=4, unique=True), parent=st.none() | ids,
          hit=st.booleans(), learned=st.booleans(), continued=st.booleans())
    def reference(self, chain: list[int], parent: int | None, hit: bool, learned: bool, continued: bool) -> None:
        tier = self.tier
        keys = [key(i) for i in chain]
        new = [k for k in keys if k not in tier.slot_of]
        if len(new) > len(tier.free):
            return
        up = key(parent) if parent is not None and key(parent) in tier.slot_of else None
        if up in keys:
            up = None
        for k in new:
            tier.insert(k)
            self.writing.add(k)
        tier.policy.classes.hold = [tier.policy.max_hold * c // CLASSES if learned else 0 for c in range(CLASSES)]
        if continued and up is not None and not hit:
            # The same request's next store (the policy checks that it does continue one).
            tier.policy.continue_chain(keys, [tier.slot_of[k] for k in keys], tier.slot_of[up])
        else:
            tier.reference_chain(keys, up, hit=hit and not new)

    @rule(i=ids)
    def end(self, i: int) -> None:
        k = key(i)
        if k in self.tier.slot_of:  # the end of the request whose last store ended in k, if any
            slot = self.tier.slot_of[k]
            self.tier.policy.end_request(slot)
            assert slot not in self.tier.policy._open and slot not in self.tier.policy._open_old

    @rule(i=ids, batched=st.booleans())
    def complete(self, i: int, batched: bool) -> None:
        k = key(i)
        if k in self.writing:
            self.writing.discard(k)
            self.ready.add(k)
            if batched:  # the CPU tier's form (a decode store's single block takes its own path)
                self.tier.policy.mark_evictable_many([k], [self.tier.slot_of[k]])
            else:
                self.tier.mark_evictable(k)

    @rule(i=ids)
    def fail(self, i: int) -> None:
        k = key(i)
        if k in self.writing:
            self.writing.discard(k)
            self.tier.remove(k)

    @rule(i=ids)
    def pin(self, i: int) -> None:
        k = key(i)
        if k in self.ready:
            self.ready.discard(k)
            self.pinned.add(k)
            self.tier.mark_pinned(k)

    @rule(i=ids)
    def unpin(self, i: int) -> None:
        k = key(i)
        if k in self.pinned:
            self.pinned.discard(k)
            self.ready.add(k)
            self.tier.mark_evictable(k)

    @rule(i=ids)
    def touch(self, i: int) -> None:
        k = key(i)
        if k in self.tier.slot_of or self.tier.free:
            self.tier.touch(k)

    @rule(n=st.integers(0, 4), protected=st.sets(ids, max_size=4))
    def evict(self, n: int, protected: set[int]) -> None:
        spy = ScanSpy(key(i) for i in protected)
        before = self.tier.evictable_count()
        chosen = self.tier.evict(n, spy)
        assert not (self.pinned | self.writing).intersection(spy.asked), "evict scanned a pinned or in-flight key"
        qualify = len(self.ready - spy.keys)
        if chosen is None:
            assert n > qualify
            assert self.tier.evictable_count() == before
            return
        assert len(chosen) == n == len(set(chosen)) and n <= qualify
        for k in chosen:
            assert k in self.ready and k not in spy.keys
            self.ready.discard(k)

    @rule(first=st.lists(ids, min_size=1, max_size=3, unique=True), more=st.lists(ids, min_size=1, max_size=2))
    def decode(self, first: list[int], more: list[int]) -> None:
        # A request stored once, then a block at a time (its decode), every block completed: it is
        # open (the rule above reaches this state only rarely: its parent is a random block).
        ids = first + [i for i in dict.fromkeys(more) if i not in first]
        if any(key(i) in self.tier.slot_of for i in ids) or len(ids) > len(self.tier.free):
            return
        store(self.tier, first, end=False)
        for parent, i in itertools.pairwise(ids[len(first) - 1 :]):
            store_more(self.tier, [i], parent)
        self.ready.update(key(i) for i in ids)

    @rule(references=st.integers(1, 700))
    def elapse(self, references: int) -> None:
        # Other blocks' references pass: the clock runs on (past open requests' holds, say).
        self.tier.policy._now += references

    @rule()
    def fall_back(self) -> None:
        # The guard stops the learned holds: every hold ends now, open blocks keep their expiry.
        policy = self.tier.policy
        policy._release_holds(policy._now)

    @precondition(lambda self: bool(self.tier.slot_of))
    @rule()
    def clear(self) -> None:
        self.tier.clear()
        self.ready.clear()
        self.pinned.clear()
        self.writing.clear()

    @invariant()
    def structure(self) -> None:
        assert self.tier.evictable_count() == len(self.ready)
        assert set(self.tier.slot_of) == self.ready | self.pinned | self.writing
        check_invariants(self.tier)


StructureMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestReturnTimeStructure = StructureMachine.TestCase


@pytest.mark.timeout(20)
def test_the_guard_falls_back_after_an_open_request_outlived_its_hold() -> None:
    # Regression (2026-12-05): a request stored a block at a time is open, its blocks' expiry its
    # first store's clock plus the longest hold. Once the clock passed that, the guard's fallback
    # (_release_holds) moved each open block to the tail of the list it was walking, and two of
    # them traded places there forever: the engine's scheduler thread hung.
    policy = ReturnTimePolicy(6)
    tier: Slotted[ReturnTimePolicy] = Slotted(policy)
    keys = [key(i) for i in (1, 2, 3)]
    store(tier, [1], end=False)
    store_more(tier, [2], 1)  # decode stores, each continuing the request
    store_more(tier, [3], 2)
    assert all(policy._expiry[tier.slot_of[k]] >= OPEN for k in keys)
    policy._now += 2 * policy.max_hold + 10 * policy._width  # other blocks' references
    policy._release_holds(policy._now)
    check_invariants(tier)
    assert all(policy._expiry[tier.slot_of[k]] >= OPEN for k in keys), "an open request keeps its expiry"
    assert evict_all(tier) == [3, 2, 1]


def test_an_eviction_that_opens_a_request_never_takes_a_block_twice() -> None:
    # Review r5: E F G stored at once; E's and G's copies done, F's not. evict(2) passes over E (its
    # child F is held), then reaches G, the request's marked tail, and opens the request: E moved
    # into a later list and was passed a second time, so the eviction took it twice ([E, b""]) and
    # the evictable count went one too low for good. Only E qualifies: the answer is None.
    policy = ReturnTimePolicy(3)
    e, f, g = key(1), key(2), key(3)
    policy.insert_many([e, f, g], [0, 1, 2])
    policy.reference_chain([e, f, g], [0, 1, 2], -1, False)
    policy.mark_evictable_many([e], [0])
    policy.mark_evictable_many([g], [2])
    assert policy.evict(2, {g}) is None
    assert policy.evictable_count() == 2
    assert policy.evict(1, {g}) == [e]


def test_a_stale_parent_link_never_walks_a_request_into_a_free_slot() -> None:
    # Review r6: an eviction that finds no leaf takes a middle block (a1); its child a2 keeps a link
    # to the freed slot. A request stored after a2 raised its ancestors through that link and gave
    # the free slot an expiry equal to A's held one; A's next store then walked into the free slot
    # when its blocks opened and read the empty key's last byte: IndexError out of continue_chain.
    policy = ReturnTimePolicy(8)
    width = policy._width
    a0, a1, a2, b0, a3 = key(1), key(2), key(3), key(4), key(5)
    hold = [100 * width] * CLASSES  # as if learned
    hold[BASE_OF_NEW[3] + LAST] = 0  # A's last block held 0, its body 100 widths
    policy.classes.hold = hold
    policy.insert_many([a0, a1, a2], [0, 1, 2])
    policy.reference_chain([a0, a1, a2], [0, 1, 2], -1, False)
    policy.mark_evictable_many([a1, a0], [1, 0])  # a2's copy still running
    assert policy.evict(1, {a0}) == [a1]  # no leaf: a1 goes, a2 names a free slot
    policy.classes.hold = [100 * width - policy._now] * CLASSES  # B's hold ends where A's body's does
    policy.insert(b0, 3)
    policy.reference_chain([b0], [3], 2, False)
    assert policy._expiry[1] == 0, "a free slot keeps expiry 0"
    policy.insert(a3, 4)
    policy.continue_chain([a3], [4], 2)  # no IndexError
    assert policy._key_of[4] == a3 and policy._parent[4] == 2


def test_a_fallback_between_a_load_and_its_store_ends_the_loaded_blocks_holds_too() -> None:
    # Review (2026-12-05): a store that follows the load of its own prefix gives the loaded blocks
    # the classes of its request, keeping at least the expiry each had before the load. A guard
    # fallback between the two (the solve that ends a load's reference may run it) ended every
    # hold, but the store then put the loaded blocks' learned holds back from that record.
    policy = ReturnTimePolicy(16)
    tier: Slotted[ReturnTimePolicy] = Slotted(policy)
    width = policy._width
    policy.classes.hold = [100 * width] * CLASSES  # as if learned
    store(tier, [1, 2, 3])
    store(tier, [9])
    load(tier, [1, 2])
    loaded = [tier.slot_of[key(i)] for i in (1, 2)]
    assert all(policy._expiry[s] >= 100 * width for s in loaded)
    policy.classes.hold = [0] * CLASSES  # the guard fell back: LRU order (ReturnTimePolicy._solve)
    policy._release_holds(policy._now)
    floor = max(policy._now, 1)
    assert all(policy._expiry[s] <= floor for s in loaded)
    for i in (6, 7):
        tier.insert(key(i))
    # 3 is held already (the general path), 6 and 7 are new: the loaded blocks are reclassified.
    tier.reference_chain([key(3), key(6), key(7)], key(2), hit=False)
    ready(tier, [6, 7])
    check_invariants(tier)
    held = {i: policy._expiry[tier.slot_of[key(i)]] for i in (1, 2, 3, 6, 7)}
    assert all(e <= policy._now for e in held.values()), f"a hold outlived the fallback: {held} at {policy._now}"
    assert evict_all(tier) == [9, 7, 6, 3, 2, 1]


def test_what_stays_of_a_request_cut_by_an_eviction_is_no_longer_held_open() -> None:
    # Found on a held-out trace (2026-12-05): an open request's blocks are held after nearly every
    # other block. Once an eviction took its tail (nothing else qualified: the request is longer
    # than the tier), the rest of it stayed open for the longest hold, and the blocks other
    # requests reused went first. Now what stays is settled as the request's body, from its
    # last store, before the next chain.
    policy = ReturnTimePolicy(6)
    tier: Slotted[ReturnTimePolicy] = Slotted(policy)
    store(tier, [1])
    store(tier, [10, 11, 12], end=False)  # a request stored in pieces
    store_more(tier, [13, 14], 12)
    assert all(policy._expiry[tier.slot_of[key(i)]] >= OPEN for i in (10, 11, 12, 13, 14))
    assert tier.evict(2) == [key(1), key(14)]  # its next piece: 1, then its own tail
    for i in (15, 16):
        tier.insert(key(i))
    tier.reference_chain([key(15), key(16)], None, hit=False)  # its parent is gone: a new request
    ready(tier, [15, 16])
    check_invariants(tier)
    assert all(policy._expiry[tier.slot_of[key(i)]] < OPEN for i in (10, 11, 12, 13)), "the rest is settled"
    assert not policy._cut
    # The guard's miniature of the learned holds settles the request's sampled blocks too (it held
    # them open the same way, so it measured a cache with the flaw).
    mini = policy.guard.mini
    followed = [mini.expiry[e] for i in range(10, 15) if (e := mini.table.find(fingerprint(key(i)))) >= 0]
    assert followed, "the request's blocks are sampled"
    assert all(e < OPEN for e in followed), followed
    end(tier, 16)
    assert evict_all(tier) == [13, 12, 11, 10, 16, 15]


def test_an_eviction_finds_a_block_its_owner_moved_behind_the_scan() -> None:
    # Found by the structure machine (2026-12-05): the eviction reaches the marked tail of a request
    # that stored once and opens it; the open expiry (its first store's clock plus the longest
    # hold) was past, so the block moved into the expired list, which the scan had passed: the
    # eviction answered None although the block qualified (a store refused for nothing).
    policy = ReturnTimePolicy(6)
    tier: Slotted[ReturnTimePolicy] = Slotted(policy)
    store(tier, [4], end=False)  # stored once, not ended: its record holds it, its tail marked
    policy._now += 2 * policy.max_hold + 10 * policy._width  # other blocks' references
    for i in (9, 8):
        tier.insert(key(i))
    # Another request references 4 now (9 and 8 still being written): 4 is held from now on,
    # while its own request's open expiry is long past.
    tier.reference_chain([key(9), key(4), key(8)], None, hit=False)
    assert tier.evictable_count() == 1
    assert tier.evict(1) == [key(4)]
    check_invariants(tier)


@pytest.mark.parametrize("settled_by", ["cut", "end"])
def test_a_store_after_a_load_never_holds_a_settled_block_open_again(settled_by: str) -> None:
    # Review (2026-12-05): Q loads blocks of request R while R is open, remembering their open
    # expiry; R is settled before Q's store (an eviction cuts it, or it ends); Q's store then
    # reclassified the loaded blocks with that open expiry as their floor and raised their
    # ancestors to it: held open, with no record left to settle them.
    policy = ReturnTimePolicy(8)
    tier: Slotted[ReturnTimePolicy] = Slotted(policy)
    store(tier, [1])  # a shared prefix
    store(tier, [10, 11, 12], parent=1, end=False)  # request R after it, in pieces: open
    store_more(tier, [13, 14], 12)
    store(tier, [30])
    store(tier, [31])
    load(tier, [1, 10, 11])  # request Q loads the prefix and R's first blocks
    if settled_by == "cut":  # Q's store's eviction takes R's tail
        assert tier.evict(2, {key(i) for i in (1, 10, 11, 12, 30, 31)}) == [key(14), key(13)]
    else:
        end(tier, 14)
        tier.evict(2, {key(i) for i in (1, 10, 11, 12)})
    for i in (20, 21):
        tier.insert(key(i))
    tier.reference_chain([key(12), key(20), key(21)], key(11), hit=False)  # 12 held: the general path
    ready(tier, [20, 21])
    check_invariants(tier)
    held_open = [k for k, s in tier.slot_of.items() if policy._expiry[s] >= OPEN]
    assert not held_open, f"{len(held_open)} blocks held open with no request open"
