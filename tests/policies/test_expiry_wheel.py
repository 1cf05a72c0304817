"""ExpiryWheel, the storage of return-time: with every hold 0 it keeps LRU's order, heads protected."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_helpers import Slotted, key

from kvtier.policies import LRUPolicy
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.return_time import ExpiryWheel
from kvtier.policies.return_time.wheel import OPEN

Tree = list[list[int]]


def requests_over_a_prefix_tree(draw: st.DrawFn) -> list[list[int]]:
    """Requests that are paths from the root of a small prefix tree (block ids: node numbers)."""
    children: dict[int, list[int]] = {}
    nodes = 1
    out: list[list[int]] = []
    for _ in range(draw(st.integers(1, 60))):
        path: list[int] = []
        node = -1
        for _ in range(draw(st.integers(1, 6))):
            kids = children.setdefault(node, [])
            if kids and draw(st.booleans()):
                node = draw(st.sampled_from(kids))
            else:
                kids.append(nodes)
                node = nodes
                nodes += 1
            path.append(node)
        out.append(path)
    return out


def replay(policy: EvictionPolicy, requests: list[list[int]]) -> list[bytes]:
    """Drive ``policy`` as the CPU tier does (load the hit prefix, store the rest); the keys it evicts."""
    tier: Slotted[EvictionPolicy] = Slotted(policy)
    evicted: list[bytes] = []
    for ids in requests:
        keys = [key(i) for i in ids]
        h = 0
        while h < len(keys) and keys[h] in tier.slot_of:
            h += 1
        if h:
            tier.reference_chain(keys[:h], hit=True)
        rest = keys[h:]
        new = [k for k in rest if k not in tier.slot_of]
        shortfall = len(new) - len(tier.free)
        if shortfall > 0:
            chosen = tier.evict(shortfall, set(keys))
            if chosen is None:
                continue
            evicted += chosen
        for k in new:
            tier.insert(k)
        if rest:
            tier.reference_chain(rest, keys[h - 1] if h else None, hit=False)
        for k in reversed(new):
            tier.mark_evictable(k)
    return evicted


def lru_of_whole_requests(capacity: int, requests: list[list[int]]) -> list[bytes]:
    """The reference: an LRU list in which a request makes every block of its prefix the most
    recent, tail first (so a stored block's ancestors are never older than it)."""
    order: list[int] = []  # least recent first
    evicted: list[bytes] = []
    for ids in requests:
        held = set(order)
        missing = [i for i in ids if i not in held]
        if len(order) + len(missing) > capacity:
            victims = [i for i in order if i not in ids][: len(order) + len(missing) - capacity]
            if len(victims) < len(order) + len(missing) - capacity:  # refused: only the hit prefix was used
                hit = ids[: next((n for n, i in enumerate(ids) if i not in held), len(ids))]
                order = [i for i in order if i not in hit] + hit[::-1]
                continue
            evicted += [key(i) for i in victims]
            order = [i for i in order if i not in victims]
        order = [i for i in order if i not in ids] + ids[::-1]
    return evicted


@settings(max_examples=300, deadline=None)
@given(st.composite(requests_over_a_prefix_tree)(), st.integers(2, 12))
def test_with_every_hold_zero_the_wheel_is_lru_over_whole_requests(requests: list[list[int]], capacity: int) -> None:
    assert replay(ExpiryWheel(capacity), requests) == lru_of_whole_requests(capacity, requests)


def test_plain_lru_cuts_a_prefix_at_its_head_where_the_wheel_does_not() -> None:
    # The load of block 1 comes before the store of 2, so plain LRU holds 2 as more recent than
    # its parent and evicts the head; the wheel raises the parent with its child.
    requests = [[1], [1, 2], [3]]
    assert replay(LRUPolicy(2), requests) == [key(1)]
    assert replay(ExpiryWheel(2), requests) == [key(2)]


def test_a_block_held_longer_outlives_blocks_referenced_after_it() -> None:
    wheel = ExpiryWheel(8, horizon=1000)
    tier: Slotted[ExpiryWheel] = Slotted(wheel)
    for i in (1, 2, 3):  # three requests, one block each: LRU would take 1 first
        tier.insert(key(i))
        tier.reference_chain([key(i)], hit=False)
    wheel._expiry[tier.slot_of[key(1)]] = 500  # its owner (a policy) held it 500 references
    for i in (1, 2, 3):
        tier.mark_evictable(key(i))
    assert tier.evict(2) == [key(2), key(3)]
    assert tier.evict(1) == [key(1)]
    assert wheel.evictable_count() == 0


@pytest.mark.timeout(20)
def test_releasing_the_holds_keeps_open_blocks_whose_time_passed_where_they_are() -> None:
    """Regression (2026-12-05): ``_release_holds`` walked the expired list and moved each open block
    to the tail of its expiry's list; for an open block whose bucket the clock had passed, that list
    is the one walked, and two such blocks traded places at its tail forever (a replay of a held-out
    LRU-friendly trace, mixed stores, 192 blocks, hung in the guard's first fallback)."""
    wheel = ExpiryWheel(8, horizon=1000)
    tier: Slotted[ExpiryWheel] = Slotted(wheel)
    keys = [key(i) for i in range(1, 6)]
    for k in keys:  # one-block requests
        tier.insert(k)
        tier.reference_chain([k], hit=False)
    for k in (keys[0], keys[2], keys[3]):  # open (their requests store on), held until clock 5
        wheel._expiry[tier.slot_of[k]] = OPEN | 5
    wheel._expiry[tier.slot_of[keys[4]]] = 900  # a hold that the release ends
    for k in keys:
        tier.mark_evictable(k)
    now = 100 * wheel._width  # the clock is far past clock 5's bucket
    wheel._release_holds(now)
    assert [wheel._expiry[tier.slot_of[k]] for k in keys] == [OPEN | 5, 1, OPEN | 5, OPEN | 5, now]
    assert wheel.evictable_count() == 5
    assert sorted(tier.evict(5) or []) == keys
    assert wheel.evictable_count() == 0
