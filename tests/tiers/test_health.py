"""CircuitBreaker: closed -> open -> half-open -> closed, with a controllable clock."""

from __future__ import annotations

from kvtier.tiers.base import HealthState
from kvtier.tiers.health import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_threshold_and_recovers_through_half_open() -> None:
    clock = Clock()
    cb = CircuitBreaker(failure_threshold=3, open_seconds=5.0, clock=clock)
    cb.record_failure("a")
    cb.record_failure("b")
    assert cb.serving
    cb.record_failure("c")
    assert cb.state is HealthState.OPEN and not cb.serving
    assert cb.health().detail == "c" and cb.health().consecutive_failures == 3
    clock.now = 4.9
    assert cb.state is HealthState.OPEN
    clock.now = 5.0
    assert cb.probe_due()
    cb.record_failure("probe failed")
    assert cb.state is HealthState.OPEN, "a failed probe re-opens at once"
    clock.now = 10.0
    assert cb.state is HealthState.HALF_OPEN
    cb.record_success()
    assert cb.state is HealthState.CLOSED and cb.health().consecutive_failures == 0
    assert cb.times_opened == 2


def test_success_resets_the_count_and_slow_counts_as_failure() -> None:
    cb = CircuitBreaker(failure_threshold=2, slow_seconds=0.1, clock=Clock())
    cb.record_failure()
    cb.record_success(0.01)
    cb.record_failure()
    assert cb.serving
    cb.record_success(0.5)
    assert cb.state is HealthState.OPEN


def test_trip_opens_at_once() -> None:
    cb = CircuitBreaker(failure_threshold=10, clock=Clock())
    cb.trip("connection refused")
    assert cb.state is HealthState.OPEN and cb.health().detail == "connection refused"


def test_answering_means_closed_with_no_failure_since_the_last_success() -> None:
    clock = Clock()
    cb = CircuitBreaker(failure_threshold=2, open_seconds=1.0, clock=clock)
    assert cb.answering
    cb.record_failure("a")
    assert cb.serving and not cb.answering, "still serving, but the medium failed last time"
    cb.record_success()
    assert cb.answering
    cb.trip("refused")
    clock.now = 1.0
    assert cb.probe_due() and not cb.answering
    cb.record_success()
    assert cb.answering
