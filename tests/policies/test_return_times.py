"""The learning half of the return-time policy: sampler, sampled LRU, survival curves, holding plan."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.policies.return_time.model import (
    ReturnSampler,
    ReturnTimeModel,
    _upper_hull,
    sample_threshold,
)


def test_sample_threshold_covers_the_requested_share_of_last_bytes() -> None:
    assert sample_threshold(0.25) == 64
    assert sample_threshold(1e-9) == 1, "at least one byte value is sampled"
    assert sample_threshold(2.0) == 256


def test_age_buckets_are_log_spaced_up_to_the_horizon() -> None:
    model = ReturnTimeModel(1, 10_000)
    edges = model.edges
    assert edges[0] == 0 and edges[-1] == 10_000
    assert np.all(np.diff(edges) > 0)
    assert model.age_bucket(1) == 0
    assert model.age_bucket(10_000) == len(edges) - 2
    assert model.age_bucket(10**9) == len(edges) - 2
    j = model.age_bucket(500)
    assert edges[j] < 500 <= edges[j + 1]


def test_survival_follows_the_observed_returns() -> None:
    model = ReturnTimeModel(2, 1000, prior=0.0)
    for _ in range(30):
        model.record(0, 10)  # class 0 comes back after 10 references, always
    for _ in range(10):
        model.record(1, 500)  # class 1: a quarter after 500, the rest never
    for _ in range(30):
        model.censor(1, 1000)
    model.solve(100, [30, 40], 1000.0, 1.0)
    survival = model.survival(model.events, model.censored)
    j10 = model.age_bucket(10)
    assert survival[0, j10] == 1.0 and survival[0, j10 + 1] == 0.0
    assert survival[1, -1] == pytest.approx(0.75)


def test_censored_blocks_still_in_view_count_as_at_risk() -> None:
    model = ReturnTimeModel(1, 1000, prior=0.0)
    for _ in range(10):
        model.record(0, 100)
    # 30 sampled blocks not back yet at age 50: they were at risk before 50, unknown after.
    in_progress = (np.zeros(30, dtype=np.uint8), np.full(30, 50, dtype=np.int64))
    model.solve(100, [40], 1000.0, 1.0, in_progress)
    survival = model.survival(model.events, model.censored)
    assert survival[0, -1] == pytest.approx(0.0), "beyond age 50 only the 10 returns are at risk"
    with_progress = model.censored.copy()
    with_progress[0, model.age_bucket(50)] += 30
    assert model.survival(model.events, with_progress)[0, model.age_bucket(50)] == 1.0


def test_sparse_classes_follow_the_pooled_curve() -> None:
    model = ReturnTimeModel(2, 1000, prior=8.0)
    for _ in range(200):
        model.record(0, 20)
    model.record(1, 900)  # one observation: not enough to disagree with the pool
    model.solve(100, [200, 1], 1000.0, 1.0)
    survival = model.survival(model.events, model.censored)
    assert survival[1, model.age_bucket(20) + 1] < 0.5


def test_upper_hull_skips_points_below_the_chords() -> None:
    x = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    y = np.array([0.0, 0.1, 1.0, 1.1, 1.15])
    assert _upper_hull(x, y) == [(0, 2), (2, 3), (3, 4)]
    assert _upper_hull(np.array([0.0, 1.0, 1.0]), np.array([0.0, 0.5, 0.7])) == [(0, 2)]


def test_the_plan_holds_the_denser_class_and_fills_the_capacity() -> None:
    model = ReturnTimeModel(3, 1000, prior=0.0)
    for _ in range(100):
        model.record(0, 10)  # returns soon: dense
        model.record(1, 400)  # returns late: sparse
        model.censor(2, 1000)  # never returns
    plan = model.solve(40, [100, 100, 100], 300.0, 1.0)
    assert plan.hold[0] >= 10, "the dense class is held until it returns"
    assert plan.hold[2] == 0, "a class that never returns is never held"
    assert plan.hold[1] == 0 and plan.partial == 1, "the sparse class gets what room is left, for a share"
    assert 0.0 < plan.fraction < 1.0 and plan.extended >= 400
    assert plan.learned_hits > plan.lru_hits


def test_decay_forgets_old_observations() -> None:
    model = ReturnTimeModel(1, 1000, prior=0.0)
    for _ in range(100):
        model.record(0, 10)
    model.solve(10, [100], 100.0, 1.0)
    model.solve(10, [0], 100.0, 0.5)
    assert model.events.sum() == pytest.approx(50.0)


def test_sampler_reports_returns_and_censors_what_it_loses() -> None:
    model = ReturnTimeModel(4, 100, prior=0.0)
    sampler = ReturnSampler(2, 100, model)
    assert sampler.observe(11, now=0, cls=1) == -1
    assert sampler.observe(11, now=30, cls=2) == 1 and sampler.last_age == 30
    sampler.reclass(11, 3)
    assert sampler.observe(22, now=40, cls=0) == -1
    assert sampler.observe(33, now=50, cls=0) == -1  # full: 11 (class 3, age 20) is censored
    model.solve(1, [0] * 4, 1.0, 1.0)
    assert model.censored[3].sum() == 1
    sampler.expire(200)  # 22 and 33 were not seen for the horizon
    model.solve(1, [0] * 4, 1.0, 1.0)
    assert model.censored[0, -1] == 2
    classes, ages = sampler.in_progress(200)
    assert len(classes) == len(ages) == 0


def test_sampler_estimates_an_lru_of_lru_size_entries() -> None:
    model = ReturnTimeModel(1, 1000, prior=0.0)
    sampler = ReturnSampler(4, 1000, model, lru_size=2)
    hits = []
    for now, fp in enumerate([1, 2, 1, 3, 2, 1, 1]):
        sampler.observe(fp, now, 0)
        hits.append(sampler.lru_hit)
    # LRU of 2 over 1 2 1 3 2 1 1: miss miss hit miss miss(2 was pushed out by 3) miss hit
    assert hits == [False, False, True, False, False, False, True]
    assert sampler.table.count(0) == 2 and len(sampler.table) == 3
    with pytest.raises(ValueError, match="lru_size"):
        ReturnSampler(4, 1000, model, lru_size=5)
