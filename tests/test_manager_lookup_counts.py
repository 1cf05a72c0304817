"""Lookup answers and lookup timing as the snapshot reports them.

HITs are counted from the step's log of hit keys (no counter per HIT on the fast path), and
one step with lookups in ``lookup_timing_every`` has every lookup timed: these tests drive a
real manager (real /dev/shm region, LRU CPU tier) through random steps and compare the
snapshot with the answers the calls gave.
"""

from __future__ import annotations

from collections.abc import Iterator
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import LookupResult, Namespace, RequestContext, TieringManager, prefix_keys
from kvtier.manager import step_hits
from kvtier.manager.step_hits import TIMED_LOOKUPS

pytestmark = pytest.mark.usefixtures("shm_leak_check")

HIT, MISS = LookupResult.HIT, LookupResult.MISS
BLOCKS = 6


def timed_in_step(calls: list[tuple[str, list[LookupResult]]], cap: int) -> int:
    """The lookups a timed step times, by the model: its calls in order (``lookup``: one answer;
    ``prefix``: a lookup_prefix's answers), each lookup one sample, each run of CPU hits a
    prefix scan answers after the step's first lookup as many at once, until ``cap`` samples
    (a run times only as many as are left: those a lookup per key would time)."""
    left, timed, first = cap, 0, True
    for kind, answers in calls:
        units: list[int] = []
        if kind == "lookup":
            units.append(1)
        else:
            i = 0
            if first:  # the step's first lookup is answered alone (it polls and decides the timing)
                units.append(1)
                i = 1
            while i < len(answers):
                j = i
                while j < len(answers) and answers[j] is HIT:
                    j += 1
                if j > i:
                    units.append(j - i)
                if j < len(answers):
                    units.append(1)
                i = j + 1
        first = False
        for n in units:
            take = min(n, left)
            timed += take
            left -= take
    return timed


def keys(n: int, seed: int = 0) -> list[bytes]:
    return prefix_keys(np.arange(n * 4) + seed * 100_000, 4)


@pytest.fixture
def manager(namespace: Namespace) -> Iterator[TieringManager]:
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=BLOCKS, policy="lru")
    yield mgr
    mgr.shutdown()


def store(mgr: TieringManager, ks: list[bytes]) -> bool:
    plan = mgr.prepare_store(ks)
    if plan is None:
        return False
    mgr.complete_store(plan.keys_to_store)
    return True


@pytest.mark.parametrize("timed", [True, False])
def test_hits_logged_before_a_store_in_the_same_step_are_counted(manager: TieringManager, timed: bool) -> None:
    """A store's eviction empties the step's log of HIT keys into the protected set mid-step: the
    HITs before it still count, once (the count used to come from a countdown per lookup), in a
    step whose lookups are timed (the first with lookups) and in one that takes the fast path."""
    ks = keys(BLOCKS)
    assert store(manager, ks)
    manager.on_schedule_end()
    answers: list[LookupResult] = []
    if not timed:
        answers.append(manager.lookup(ks[0]))  # the timed step
        manager.on_schedule_end()
    answers += [manager.lookup(k) for k in ks[:3]]  # the first is the step's full path, then the hot path
    assert manager._fast is not timed  # type: ignore[attr-defined]
    assert store(manager, keys(2, seed=1))  # evicts two blocks the step did not hit
    answers += [manager.lookup(k) for k in ks[:4]]
    manager.on_schedule_end()
    answers += manager.lookup_prefix(ks).answers
    snap = manager.stats()
    hits = answers.count(HIT)
    assert hits >= 7 + (not timed), answers
    assert snap.cpu.lookups.hit == hits and snap.manager.lookups["hit"] == hits
    assert snap.cpu.lookups.miss == answers.count(MISS) == snap.manager.lookups["miss"]


def test_one_step_with_lookups_in_every_n_has_each_lookup_timed(manager: TieringManager) -> None:
    manager.lookup_timing_every = 3
    ks = keys(4)
    assert store(manager, ks)
    timed = 0
    for step in range(9):
        manager.on_schedule_end()
        if step % 2:  # steps without lookups do not count towards the next timed one
            manager.on_schedule_end()
        answers = [manager.lookup(k) for k in ks] + [manager.lookup(b"absent")]
        answers += manager.lookup_prefix(ks[:2]).answers
        if step % 3 == 0:  # the first step with lookups, then every third
            timed += len(answers)
    assert manager.stats().cpu.lookup_seconds.count == timed == 3 * 7


def test_a_timed_step_times_its_first_lookups_then_takes_the_fast_path(manager: TieringManager) -> None:
    """A step of more lookups than :data:`TIMED_LOOKUPS` (as an engine step of many requests
    has) times only that many; the rest are answered by the fast path, and counted all the same."""
    ks = keys(4)
    assert store(manager, ks)
    manager.on_schedule_end()
    n = 3 * TIMED_LOOKUPS
    answers = [manager.lookup(ks[i % 4]) for i in range(n)]
    assert answers == [HIT] * n
    assert manager._fast  # type: ignore[attr-defined]
    snap = manager.stats()
    assert snap.cpu.lookup_seconds.count == TIMED_LOOKUPS
    assert snap.cpu.lookups.hit == n


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cap=st.integers(1, 12),
    every=st.integers(1, 4),
    steps=st.lists(
        st.lists(
            st.one_of(
                st.tuples(st.just("lookup"), st.integers(0, 9), st.just(1)),
                st.tuples(st.just("prefix"), st.integers(0, 9), st.integers(1, 5)),
                st.tuples(st.just("store"), st.integers(0, 9), st.integers(1, 3)),
            ),
            max_size=8,
        ),
        max_size=8,
    ),
)
def test_snapshot_counts_and_timings_match_the_answers(
    namespace: Namespace, cap: int, every: int, steps: list[list[tuple[str, int, int]]]
) -> None:
    """Random steps of lookups, prefix scans and stores (a store evicts, which empties the HIT
    log mid-step; it stores the keys a lookup just answered MISS): the snapshot's HIT and MISS
    counts are the answers given, and the lookups timed are exactly the first ``cap`` (as a lookup per
    key would time them) of the first step with lookups and of every ``every``-th
    step with lookups after it."""
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=BLOCKS, policy="lru")
    mgr.lookup_timing_every = every
    patch = mock.patch.object(step_hits, "TIMED_LOOKUPS", cap)
    patch.start()
    try:
        pool = keys(10, seed=7)
        req = RequestContext("r")
        mgr.on_new_request(req)
        answers: list[LookupResult] = []
        timed = steps_with_lookups = 0
        for ops in steps:
            step: list[LookupResult] = []
            calls: list[tuple[str, list[LookupResult]]] = []
            for kind, at, size in ops:
                if kind == "lookup":
                    step.append(mgr.lookup(pool[at], req))
                    calls.append(("lookup", step[-1:]))
                elif kind == "prefix":
                    got = mgr.lookup_prefix(pool[at : at + size], req).answers
                    step += got
                    calls.append(("prefix", got))
                else:
                    missing = []
                    for k in pool[at : at + size]:
                        step.append(mgr.lookup(k, req))
                        calls.append(("lookup", step[-1:]))
                        if step[-1] is MISS:
                            missing.append(k)
                    plan = mgr.prepare_store(missing, req)
                    if plan is not None:
                        mgr.complete_store(plan.keys_to_store, req)
            mgr.on_schedule_end()
            if step:
                if steps_with_lookups % every == 0:
                    timed += timed_in_step(calls, cap)
                steps_with_lookups += 1
            answers += step
        snap = mgr.stats()
        assert set(answers) <= {HIT, MISS}
        assert snap.cpu.lookups.hit == answers.count(HIT) == snap.manager.lookups["hit"]
        assert snap.cpu.lookups.miss == answers.count(MISS) == snap.manager.lookups["miss"]
        assert snap.cpu.lookup_seconds.count == timed
        mgr.on_request_finished(req)
    finally:
        patch.stop()
        mgr.shutdown()
