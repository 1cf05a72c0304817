"""FingerprintLists: fixed-size fingerprint lists with an open-addressing index.

Checked against a model of plain Python lists by a hypothesis state machine
whose fingerprints share low bits on purpose, so probe runs collide, wrap
around the index and are broken by backward-shift deletion.
"""

from __future__ import annotations

import gc
import os
import tracemalloc

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.policies.fingerprints import FREE, FingerprintLists, fingerprint

CAPACITY = 6
LISTS = 2


def test_fingerprints_are_positive_and_stable_per_key() -> None:
    keys = [os.urandom(32) for _ in range(100)]
    fps = [fingerprint(k) for k in keys]
    assert all(0 < fp < 2**63 for fp in fps)
    assert fps == [fingerprint(bytes(k)) for k in keys]  # equal keys, other objects
    assert len(set(fps)) == len(fps)


def test_lists_keep_order_and_share_one_pool() -> None:
    table = FingerprintLists(4, lists=2)
    a = table.add(11, 0)
    table.add(12, 1)
    table.add(13, 0)
    assert table.fingerprints(0) == [11, 13] and table.fingerprints(1) == [12]
    table.move_to_end(a, 1)  # from list 0 to the most recent end of list 1
    assert table.fingerprints(0) == [13] and table.fingerprints(1) == [12, 11]
    assert table.list_of(a) == 1 and table.find(11) == a
    assert table.pop_head(1) >= 0 and table.find(12) == -1
    table.add(14, 0)
    table.add(15, 0)
    assert len(table) == 4
    with pytest.raises(OverflowError, match="full"):
        table.add(16, 0)
    table.clear()
    assert len(table) == 0 and table.find(11) == -1 and table.head(0) == -1


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="capacity"):
        FingerprintLists(0)
    with pytest.raises(ValueError, match="lists"):
        FingerprintLists(4, lists=0)


def test_memory_is_allocated_once() -> None:
    n = 50_000
    gc.collect()
    tracemalloc.start()
    try:
        table = FingerprintLists(n, lists=2)
        empty = tracemalloc.get_traced_memory()[0]
        fps = [fingerprint(os.urandom(32)) for _ in range(4 * n)]
        base = tracemalloc.get_traced_memory()[0]
        for i, fp in enumerate(fps):
            if len(table) == n:
                table.pop_head(i % 2)
            table.add(fp, i % 2)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert empty / n <= 34, f"{empty / n:.1f} B per entry"
    assert grown <= 1024, f"churn grew the table by {grown} B"


class FingerprintMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = FingerprintLists(CAPACITY, lists=LISTS)
        self.model: list[list[int]] = [[] for _ in range(LISTS)]

    def _where(self, fp: int) -> int | None:
        return next((i for i, lst in enumerate(self.model) if fp in lst), None)

    # Fingerprints 1..40 with the same low bits in groups: long, colliding probe runs.
    fps = st.integers(1, 40).map(lambda i: (i % 5) + 16 * (i // 5) + 1)

    @rule(fp=fps, which=st.integers(0, LISTS - 1))
    def add(self, fp: int, which: int) -> None:
        if self._where(fp) is not None or sum(map(len, self.model)) == CAPACITY:
            return
        entry = self.table.add(fp, which)
        assert self.table.fingerprint_of(entry) == fp
        self.model[which].append(fp)

    @rule(fp=fps)
    def remove(self, fp: int) -> None:
        entry = self.table.find(fp)
        where = self._where(fp)
        assert (entry >= 0) == (where is not None)
        if where is not None:
            self.table.remove(entry)
            assert self.table.list_of(entry) == FREE
            self.model[where].remove(fp)

    @rule(fp=fps, which=st.integers(0, LISTS - 1))
    def move(self, fp: int, which: int) -> None:
        where = self._where(fp)
        if where is None:
            return
        self.table.move_to_end(self.table.find(fp), which)
        self.model[where].remove(fp)
        self.model[which].append(fp)

    @rule(old=fps, fp=fps, which=st.integers(0, LISTS - 1))
    def recycle(self, old: int, fp: int, which: int) -> None:
        where = self._where(old)
        if where is None or (fp != old and self._where(fp) is not None):
            return
        entry = self.table.find(old)
        self.table.recycle(entry, fp, which)  # remove(entry), then add(fp, which) in the same entry
        assert self.table.find(fp) == entry and self.table.list_of(entry) == which
        self.model[where].remove(old)
        self.model[which].append(fp)

    @rule(which=st.integers(0, LISTS - 1))
    def pop(self, which: int) -> None:
        entry = self.table.pop_head(which)
        if not self.model[which]:
            assert entry == -1
            return
        assert self.table.fingerprint_of(entry) == self.model[which].pop(0)

    @rule()
    def clear(self) -> None:
        self.table.clear()
        self.model = [[] for _ in range(LISTS)]

    @invariant()
    def matches_the_model(self) -> None:
        assert len(self.table) == sum(map(len, self.model)), "len counts the entries in every list"
        cells = [c for c in self.table._index if c]
        assert sorted(cells) == sorted(self.table.find(fp) + 1 for lst in self.model for fp in lst), \
            "the index holds one cell per entry, no stale one"
        for which in range(LISTS):
            assert self.table.fingerprints(which) == self.model[which]
            assert self.table.count(which) == len(self.model[which])
        for i in range(1, 41):
            fp = (i % 5) + 16 * (i // 5) + 1
            entry = self.table.find(fp)
            where = self._where(fp)
            assert (entry >= 0) == (where is not None), f"index disagrees about {fp}"
            if where is not None:
                assert self.table.list_of(entry) == where


FingerprintMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
TestFingerprintsAgainstModel = FingerprintMachine.TestCase
