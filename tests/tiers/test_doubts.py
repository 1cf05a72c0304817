"""WritesInDoubt: the bookkeeping of writes whose outcome is unknown (kvtier.tiers.doubts)."""

from __future__ import annotations

import pytest

from kvtier.tiers.doubts import PROBE_INTERVAL, WritesInDoubt


def test_writes_are_due_oldest_first_once_settle_after_has_passed() -> None:
    doubts = WritesInDoubt(limit=10, settle_after=0.5)
    doubts.add([b"a", b"b"], now=1.0)
    doubts.add([b"c"], now=1.2)
    assert doubts.due(now=1.4, most=10) == []
    assert doubts.due(now=1.5, most=10) == [b"a", b"b"]
    assert doubts.due(now=1.7, most=2) == [b"a", b"b"]
    assert doubts.due(now=1.7, most=10) == [b"a", b"b", b"c"]
    doubts.add([b"a"], now=1.6)  # a later failed write of the same key: checked after that one
    assert doubts.due(now=1.8, most=10) == [b"b", b"c"]
    assert doubts.due(now=2.1, most=10) == [b"b", b"c", b"a"]


def test_discard_says_whether_the_key_was_in_doubt() -> None:
    doubts = WritesInDoubt(limit=10, settle_after=0.0)
    doubts.add([b"a"], now=0.0)
    assert b"a" in doubts and len(doubts) == 1
    assert doubts.discard(b"a") and not doubts.discard(b"a")
    assert b"a" not in doubts and len(doubts) == 0 and not doubts


def test_the_oldest_doubt_is_dropped_beyond_the_limit() -> None:
    doubts = WritesInDoubt(limit=3, settle_after=0.0)
    doubts.add([bytes([i]) for i in range(5)], now=0.0)
    assert len(doubts) == 3 and doubts.due(now=1.0, most=10) == [b"\x02", b"\x03", b"\x04"]
    with pytest.raises(ValueError, match="limit"):
        WritesInDoubt(limit=0, settle_after=0.0)


def test_checks_go_out_while_answering_else_only_idle_and_at_most_once_an_interval() -> None:
    doubts = WritesInDoubt(limit=10, settle_after=0.0)
    assert doubts.may_check(answering=True, idle=False, now=0.0)
    assert not doubts.may_check(answering=False, idle=False, now=0.0), "work waits: never a probe"
    assert doubts.may_check(answering=False, idle=True, now=10.0)
    assert not doubts.may_check(answering=False, idle=True, now=10.0 + PROBE_INTERVAL / 2)
    assert doubts.may_check(answering=True, idle=True, now=10.0 + PROBE_INTERVAL / 2), "answering: no limit"
    assert doubts.may_check(answering=False, idle=True, now=10.0 + PROBE_INTERVAL)


def test_on_size_follows_every_change_for_a_gauge() -> None:
    # (the S3 and Redis tiers keep a writes_in_doubt gauge with it: a fleet test waits for 0)
    sizes: list[int] = []
    doubts = WritesInDoubt(limit=2, settle_after=0.0, on_size=sizes.append)
    doubts.add([b"a", b"b", b"c"], now=0.0)  # (a dropped beyond the limit)
    assert not doubts.discard(b"a")
    assert doubts.discard(b"b")
    doubts.add([b"c"], now=1.0)
    assert doubts.discard(b"c")
    assert sizes == [2, 1, 1, 0]
