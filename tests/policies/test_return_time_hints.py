"""Application hints in ReturnTimePolicy: an ended conversation goes first, an expected return is held.

White-box like test_return_time.py: the expiries and the list order of the wheel.
"""

from __future__ import annotations

import math

import pytest
from policy_helpers import Slotted, key
from test_return_time import check_invariants, evict_all, store

from kvtier.policies import ARCPolicy, LRUPolicy, ReturnTimePolicy
from kvtier.policies.return_time import CLASSES
from kvtier.policies.return_time.hints import MIN_SAMPLES, HoldBudget, SessionClock
from kvtier.types import RequestHints


def hint(tier: Slotted[ReturnTimePolicy], tail: int, **hints: object) -> None:
    given = RequestHints(**hints)  # type: ignore[arg-type]
    tier.policy.hint_request(tier.slot_of[key(tail)], given.session, given.session_end, given.expected_return_s)


def held_tier(capacity: int = 64) -> Slotted[ReturnTimePolicy]:
    """A tier whose every class is held as long as any: without hints, the order is by store time."""
    tier = Slotted(ReturnTimePolicy(capacity))
    tier.policy.classes.hold = [tier.policy.max_hold] * CLASSES
    return tier


def test_an_ended_conversations_blocks_go_first_and_a_shared_prefix_stays() -> None:
    tier = held_tier()
    store(tier, [1, 2])  # a system prompt, shared
    store(tier, [10, 11, 12], parent=2)  # conversation a, turn 1
    hint(tier, 12, session="a")  # its session, on every request (records where turn 1 ended)
    store(tier, [20, 21, 22], parent=2)  # conversation b
    store(tier, [13, 14], parent=11)  # conversation a, turn 2 (after its turn 1's body; 12 was its partial last)
    store(tier, [30, 31], parent=2)  # conversation c, the most recent
    hint(tier, 14, session="a", session_end=True)
    check_invariants(tier)
    assert tier.policy.hinted["ended"] == 1
    order = evict_all(tier)
    # a's own blocks first, tail first (its turn-1 body too: 11 had only one other child, the
    # partial 12, which goes when the scan meets 11), then the rest; the shared prompt last.
    assert order[:5] == [14, 13, 12, 11, 10], order
    assert order[-2:] == [2, 1], order
    assert set(order) == {1, 2, 10, 11, 12, 13, 14, 20, 21, 22, 30, 31}


def test_an_ended_conversation_leaves_a_prefix_it_shares_with_one_other_conversation() -> None:
    """Regression (review, 2026-12-05): the walk passed any block with one other child, so a system
    prompt shared by exactly two conversations was expired with the one that ended, below the
    other conversation's live blocks (an ancestor held less than its descendants), and went first."""
    tier = held_tier()
    store(tier, [100, 101, 102, 1, 2])  # conversation a, turn 1, after a system prompt
    store(tier, [7, 8], parent=102)  # conversation b, same system prompt
    prompt = _end_conversation_a(tier)
    assert min(prompt) >= max(tier.policy._expiry[tier.slot_of[key(k)]] for k in (7, 8))
    order = evict_all(tier)
    assert order[:3] == [3, 2, 1], order
    assert order[-3:] == [102, 101, 100], order


def test_an_ended_conversation_leaves_a_shared_prefix_where_the_other_conversation_ended() -> None:
    """Review (2026-12-05): with the walk passing a branch at any recorded request end, a system
    prompt shared with a conversation whose one-block request ended right after it (its end
    recorded at the prompt's last block) was still expired. Only the ended conversation's own
    request ends (recorded with its session) let the walk pass a branch."""
    tier = held_tier()
    store(tier, [100, 101, 102, 1, 2])  # conversation a, turn 1
    hint(tier, 2, session="a")
    store(tier, [9], parent=102)  # conversation b: a one-block request after the prompt
    hint(tier, 9, session="b")
    assert min(_end_conversation_a(tier)) >= tier.policy._expiry[tier.slot_of[key(9)]]


def _end_conversation_a(tier: Slotted[ReturnTimePolicy]) -> list[int]:
    """Conversation a's turn 2 ([3] after its turn 1's 2), which ends it: the system prompt
    (100-102) keeps its expiries; returns them."""
    store(tier, [3], parent=2)
    expiry = tier.policy._expiry
    prompt = [expiry[tier.slot_of[key(k)]] for k in (100, 101, 102)]
    hint(tier, 3, session="a", session_end=True)
    check_invariants(tier)
    assert [expiry[tier.slot_of[key(k)]] for k in (100, 101, 102)] == prompt
    return prompt


def test_an_expected_return_protects_a_conversation_and_a_late_one_goes_first() -> None:
    tier = Slotted(ReturnTimePolicy(64))  # learned holds 0: LRU's order without hints
    policy = tier.policy
    for _ in range(MIN_SAMPLES + 1):  # teach the clock: 1 reference per announced second
        policy.sessions.observe("teacher", policy._now, 1.0)
        policy._now += 1
    assert policy.sessions.references(10.0) == pytest.approx(10.0, rel=0.01)
    store(tier, [1, 2, 3])  # conversation a: expected back soon
    hint(tier, 3, session="a", expected_return_s=20.0)
    store(tier, [10, 11, 12])  # conversation b: expected back in a day (never within the tier's reach)
    hint(tier, 12, session="b", expected_return_s=86400.0)
    store(tier, [20, 21])  # unhinted, the most recent
    check_invariants(tier)
    assert policy.hinted == {"ended": 0, "held": 1, "late": 1}
    expiry_a = policy._expiry[tier.slot_of[key(1)]]
    assert expiry_a >= policy._now + 10, "held until about its return"
    assert evict_all(tier) == [12, 11, 10, 21, 20, 3, 2, 1]


def test_without_a_learned_rate_an_expected_return_changes_nothing() -> None:
    hinted, plain = Slotted(ReturnTimePolicy(32)), Slotted(ReturnTimePolicy(32))
    for tier in (hinted, plain):
        store(tier, [1, 2, 3])
        store(tier, [10, 11])
    hint(hinted, 3, session="a", expected_return_s=5.0)
    assert hinted.policy.hinted == {"ended": 0, "held": 0, "late": 0}
    assert evict_all(hinted) == evict_all(plain) == [3, 2, 1, 11, 10]


def test_a_block_another_request_extended_is_left_alone() -> None:
    tier = held_tier()
    store(tier, [1, 2])
    store(tier, [3], parent=2)  # another request extends 2
    before = list(tier.policy._expiry)
    hint(tier, 2, session="x", session_end=True)
    assert list(tier.policy._expiry) == before
    check_invariants(tier)


@pytest.mark.parametrize("policy", [LRUPolicy, ARCPolicy])
def test_lru_and_arc_ignore_hints(policy: type[LRUPolicy] | type[ARCPolicy]) -> None:
    hinted, plain = Slotted(policy(16)), Slotted(policy(16))
    for tier in (hinted, plain):
        for i in range(1, 6):
            tier.insert(key(i))
            tier.policy.mark_evictable(key(i), tier.slot_of[key(i)])
    hinted.policy.hint_request(hinted.slot_of[key(5)], "s", True, 3.0)
    assert [hinted.evict(1) for _ in range(5)] == [plain.evict(1) for _ in range(5)]


def test_the_session_clock_learns_references_per_announced_second() -> None:
    clock = SessionClock(max_sessions=4)
    now = 0
    for i in range(40):  # sessions announce 10 s and come back 500 references later
        clock.observe(f"s{i % 3}", now, 10.0)
        now += 500 // 3
    assert clock.references(10.0) == pytest.approx(500, rel=0.05)
    for i in range(100):  # more sessions than kept: the oldest go
        clock.observe(f"other-{i}", now, None)
    assert len(clock) == 4


def test_the_hold_budget_reaches_as_far_as_the_room_allows() -> None:
    budget = HoldBudget(capacity=100, share=1.0, half_life=1e12)
    assert budget.reach() == 0.0
    # Per reference, returns of 10 blocks 8 references ahead (80 block-references) and
    # 10 blocks 64 ahead (640): 100 blocks of room hold the first only.
    for now in range(1, 1001):
        budget.add(now, 10, 8.0)
        budget.add(now, 10, 64.0)
    assert 8.0 < budget.reach() <= 64.0
    roomy = HoldBudget(capacity=10_000, share=1.0, half_life=1e12)
    for now in range(1, 101):
        roomy.add(now, 10, 64.0)
    assert math.isinf(roomy.reach())
