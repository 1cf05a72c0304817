"""A circuit breaker that takes a failing tier out of service and brings it back.

States: CLOSED (serving) -> OPEN after ``failure_threshold`` consecutive
failures, or one operation slower than ``slow_seconds`` counted as a failure.
While OPEN the tier answers lookups with MISS and drops stores. After
``open_seconds`` the breaker moves to HALF_OPEN: the tier runs one probe
(its own choice: a real operation or a synthetic check); a success closes the
breaker, a failure re-opens it for another ``open_seconds``.

Thread-safe: I/O threads record outcomes, the scheduler thread reads the state.
Reading the state never blocks on I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvtier.tiers.base import HealthState, TierHealth


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 5,
        open_seconds: float = 5.0,
        slow_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.failure_threshold = failure_threshold
        self.open_seconds = open_seconds
        self.slow_seconds = slow_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._state = HealthState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._detail = ""
        self.times_opened = 0

    @property
    def state(self) -> HealthState:
        """Current state; moves OPEN -> HALF_OPEN once ``open_seconds`` have passed."""
        with self._lock:
            if self._state is HealthState.OPEN and self._clock() - self._opened_at >= self.open_seconds:
                self._state = HealthState.HALF_OPEN
            return self._state

    @property
    def serving(self) -> bool:
        """True when requests may be sent (CLOSED)."""
        return self.state is HealthState.CLOSED

    @property
    def answering(self) -> bool:
        """True when CLOSED with no failure since the last success: the medium answered last time
        (upkeep that may wait on it, such as re-checking a request in doubt, waits for this)."""
        with self._lock:
            return self._state is HealthState.CLOSED and self._failures == 0

    def probe_due(self) -> bool:
        """True when the breaker is HALF_OPEN and waiting for a probe outcome."""
        return self.state is HealthState.HALF_OPEN

    def record_success(self, seconds: float = 0.0) -> None:
        if self.slow_seconds is not None and seconds > self.slow_seconds:
            self.record_failure(f"operation took {seconds:.3f}s (> {self.slow_seconds}s)")
            return
        with self._lock:
            self._failures = 0
            self._state = HealthState.CLOSED
            self._detail = ""

    def record_failure(self, detail: str = "") -> None:
        with self._lock:
            self._failures += 1
            self._detail = detail
            if self._state is HealthState.HALF_OPEN or self._failures >= self.failure_threshold:
                if self._state is not HealthState.OPEN:
                    self.times_opened += 1
                self._state = HealthState.OPEN
                self._opened_at = self._clock()

    def trip(self, detail: str = "") -> None:
        """Open at once (e.g. a connection refused that needs no retries to be sure)."""
        with self._lock:
            if self._state is not HealthState.OPEN:
                self.times_opened += 1
            self._state = HealthState.OPEN
            self._opened_at = self._clock()
            self._failures = max(self._failures, self.failure_threshold)
            self._detail = detail

    def health(self) -> TierHealth:
        state = self.state
        with self._lock:
            return TierHealth(state, self._failures, self._detail)
