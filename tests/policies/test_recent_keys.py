"""RecentKeys: a FIFO set of fingerprints in preallocated arrays, against a deque + set model."""

from __future__ import annotations

import gc
import tracemalloc
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policies.fingerprints import fingerprint
from kvtier.policies.recent_keys import RecentKeys


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity must be positive"):
        RecentKeys(0)


def test_the_oldest_entry_goes_first() -> None:
    table = RecentKeys(3)
    for fp in (11, 12, 13):
        table.add(fp)
    assert len(table) == 3 and all(fp in table for fp in (11, 12, 13))
    table.add(12)  # present: no change, nothing leaves
    assert len(table) == 3 and 11 in table
    table.add(14)
    assert 11 not in table and all(fp in table for fp in (12, 13, 14))
    assert "12" not in table  # not a fingerprint


def test_deepest_finds_the_last_recorded_key_at_or_after_low() -> None:
    keys = [bytes([i]) * 16 for i in range(10)]
    table = RecentKeys(8)
    assert table.deepest(keys, 0) == -1
    table.add(fingerprint(keys[2]))
    table.add(fingerprint(keys[6]))
    assert table.deepest(keys, 0) == 6
    assert table.deepest(keys, 7) == -1
    assert table.deepest(keys[:6], 0) == 2
    assert table.deepest(keys[:6], 3) == -1


class _HashedKey(bytes):
    """A key whose hash is chosen: hashes of 0 and -2**63 (fingerprint 1) and ones sharing home cells."""

    def __new__(cls, value: int) -> _HashedKey:
        key = super().__new__(cls, value.to_bytes(9, "little", signed=True))
        key.value = value
        return key

    value: int

    def __hash__(self) -> int:
        return self.value


# Hashes that land on home cell 0 of the index (multiples of its size, 0 and -2**63, whose
# fingerprint is 1) and next to it, so the shortcut deepest() takes from the raw hash is checked
# where it differs from the fingerprint's home.
_EDGE_HASHES = [0, -(1 << 63), 1, 2, 64, 128, -64, (1 << 62), -1 - (1 << 40), 3 << 7, (1 << 63) - 1]


_HASHES = st.sampled_from(_EDGE_HASHES) | st.integers(-(1 << 63), (1 << 63) - 1) | st.integers(-300, 300)


@settings(max_examples=400, deadline=None)
@given(
    recorded=st.lists(_HASHES, max_size=30),
    probed=st.lists(_HASHES, min_size=1, max_size=8),
    low=st.integers(0, 8),
)
def test_deepest_matches_a_scan_of_fingerprints(recorded: list[int], probed: list[int], low: int) -> None:
    # Up to 30 entries through a table of 8: the oldest leave, and with them their counts in the
    # filter deepest() reads first; membership (``in``) walks the index only.
    table = RecentKeys(8)
    for h in recorded:
        table.add(fingerprint(_HashedKey(h)))
    keys = [_HashedKey(h) for h in probed]
    expected = max((i for i in range(low, len(keys)) if fingerprint(keys[i]) in table), default=-1)
    assert table.deepest(keys, low) == expected


# Fingerprints drawn from a small range collide on the index's home cells all the time, so
# backward-shift deletion and wrap-around are exercised hard.
@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 9), fps=st.lists(st.integers(1, 40), max_size=200))
def test_matches_a_fifo_set_under_churn(capacity: int, fps: list[int]) -> None:
    table = RecentKeys(capacity)
    order: deque[int] = deque()
    for fp in fps:
        table.add(fp)
        if fp not in order:
            if len(order) == capacity:
                order.popleft()
            order.append(fp)
        assert len(table) == len(order)
        assert {f for f in range(1, 41) if f in table} == set(order)
    cells = [c for c in table._index if c]
    assert sorted(cells) == sorted(set(cells)) and len(cells) == len(order), "the index holds each entry once"


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(1, 9),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(1, 40)), max_size=200),
)
def test_replace_keeps_the_place_of_the_entry_it_replaces(capacity: int, ops: list[tuple[bool, int, int]]) -> None:
    table = RecentKeys(capacity)
    order: deque[int] = deque()

    def model_add(fp: int) -> None:
        if fp not in order:
            if len(order) == capacity:
                order.popleft()
            order.append(fp)

    for is_replace, a, b in ops:
        if is_replace:
            table.replace(a, b)
            if a != b and b not in order:
                if a in order:
                    order[order.index(a)] = b
                else:
                    model_add(b)
        else:
            table.add(a)
            model_add(a)
        assert len(table) == len(order)
        assert {f for f in range(1, 41) if f in table} == set(order)
        # deepest() reads the filter first: it must agree with membership through the index.
        keys = [_HashedKey(f) for f in range(1, 41)]
        recorded = [i for i, k in enumerate(keys) if fingerprint(k) in table]
        assert table.deepest(keys, 0) == (recorded[-1] if recorded else -1)
    cells = [c for c in table._index if c]
    assert sorted(cells) == sorted(set(cells)) and len(cells) == len(order), "the index holds each entry once"


def test_clear_forgets_everything() -> None:
    table = RecentKeys(4)
    for fp in (1, 2, 3):
        table.add(fp)
    table.clear()
    assert len(table) == 0 and 1 not in table


def test_memory_is_allocated_once() -> None:
    capacity = 1 << 16
    gc.collect()
    tracemalloc.start()
    try:
        table = RecentKeys(capacity)
        allocated = tracemalloc.get_traced_memory()[0]
        for fp in range(1, 4 * capacity):  # four times over: every entry is replaced
            table.add(fp * 0x9E3779B97F4A7C15 & ((1 << 63) - 1) or 1)
        grown = tracemalloc.get_traced_memory()[0] - allocated
    finally:
        tracemalloc.stop()
    assert len(table) == capacity
    # An 8-byte ring entry and four 4-byte index cells (the index is at most a quarter full),
    # plus the objects themselves (about 1.5 B per entry at this size).
    assert allocated / capacity <= 26, f"{allocated / capacity:.1f} B per entry"
    assert grown <= 4096, f"churn grew the table by {grown} B"
