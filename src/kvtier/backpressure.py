"""Latency-aware backpressure: skip cascades to a secondary tier whose stores got slow.

A tier's own queue sheds stores only once it is full; by then every queued
cascade keeps CPU rows pinned, so the CPU tier fills with blocks waiting for a
slow disk or a congested network, and device stores start failing for want of
room. The manager watches each tier's store latency instead:

* every completed cascade (store) job that reached the medium (it moved bytes,
  or it failed after spending time on it) gives one sample: the job's seconds
  from submit to completion, as the tier reported them (or as the manager
  measured them, submit to poll);
* the first ``warmup_jobs`` samples only seed the average (their mean), so a
  cold start never signals pressure;
* then an exponential moving average follows, weight ``smoothing`` for the
  newest sample;
* above ``high_seconds`` the tier is under pressure: new cascades to it are
  skipped (the blocks stay in the CPU tier and are evicted from there as
  usual; counted in ``skipped_jobs``/``skipped_blocks``); one cascade job at a
  time still goes through whenever the tier has no store in flight, so the
  average keeps following the tier's real latency;
* below ``low_seconds`` cascades resume (hysteresis: between the marks the
  state holds).

Loads and promotions are never shed: reads are what the engine waits for.

Scheduler thread only (the manager calls every method from it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.telemetry import BackpressureSnapshot
from kvtier.validation import check_seconds

logger = logging.getLogger(__name__)


MAX_WARMUP_JOBS = 10_000
"""The most store jobs the average may wait for before it starts (their latencies are kept until then)."""


@dataclass(frozen=True)
class BackpressureSettings:
    """When a tier counts as under pressure. See the module docstring.

    Raises :class:`ConfigError` for settings that cannot work (``enabled`` not a bool,
    ``low_seconds`` not below ``high_seconds``, non-positive values, ``smoothing`` not a
    number in (0, 1]).
    """

    enabled: bool = True
    high_seconds: float = 1.0
    low_seconds: float = 0.5
    warmup_jobs: int = 3
    smoothing: float = 0.3

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):  # "false" or "no" would be taken for True
            raise ConfigError(f"backpressure enabled must be True or False, got {self.enabled!r:.40}")
        check_seconds(self.high_seconds, "backpressure high_seconds", positive=True)
        check_seconds(self.low_seconds, "backpressure low_seconds")
        if not 0 <= self.low_seconds < self.high_seconds:
            raise ConfigError(
                f"backpressure low_seconds ({self.low_seconds!r}) must be >= 0 and below high_seconds "
                f"({self.high_seconds!r}): stores resume below the low mark, stop above the high one"
            )
        jobs = self.warmup_jobs
        if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= MAX_WARMUP_JOBS:
            raise ConfigError(
                f"backpressure warmup_jobs must be an integer in [1, {MAX_WARMUP_JOBS}], got {str(jobs)[:40]}"
            )
        smoothing = self.smoothing
        if isinstance(smoothing, bool) or not isinstance(smoothing, int | float) or not 0 < smoothing <= 1:
            raise ConfigError(f"backpressure smoothing must be a number in (0, 1], got {smoothing!r:.40}")


class StoreLatencyMonitor:
    """One secondary tier's store-latency average and pressure state (see the module docstring)."""

    def __init__(self, settings: BackpressureSettings, label: str) -> None:
        self.settings = settings
        self.label = label
        self.average: float | None = None
        self.samples = 0
        self.active = False
        self.activations = 0
        self.skipped_jobs = 0
        self.skipped_blocks = 0
        self._warmup: list[float] = []

    def observe(self, seconds: float) -> None:
        """One completed store job took ``seconds`` from submit to completion."""
        s = self.settings
        self.samples += 1
        if self.average is None:
            self._warmup.append(seconds)
            if len(self._warmup) < s.warmup_jobs:
                return
            self.average = sum(self._warmup) / len(self._warmup)
            self._warmup.clear()
        else:
            self.average += s.smoothing * (seconds - self.average)
        if not self.active and self.average > s.high_seconds:
            self.active = True
            self.activations += 1
            logger.warning(
                "tier %s: store latency averages %.3gs (above %.3gs): skipping cascades to it until it "
                "falls below %.3gs; loads and promotions continue",
                self.label, self.average, s.high_seconds, s.low_seconds,
            )
        elif self.active and self.average < s.low_seconds:
            self.active = False
            logger.warning(
                "tier %s: store latency averages %.3gs (below %.3gs): cascades to it resume "
                "(%d cascade jobs were skipped so far)",
                self.label, self.average, s.low_seconds, self.skipped_jobs,
            )

    def admit(self, blocks: int, stores_in_flight: int) -> bool:
        """Whether a new cascade job of ``blocks`` blocks may go to the tier now.

        Under pressure only a job that finds no store of the tier in flight is
        admitted (it keeps the average current); the others are skipped and counted.
        """
        if not self.active or stores_in_flight == 0:
            return True
        self.skipped_jobs += 1
        self.skipped_blocks += blocks
        return False

    def snapshot(self) -> BackpressureSnapshot:
        return BackpressureSnapshot(
            active=self.active,
            store_latency_avg=self.average,
            samples=self.samples,
            activations=self.activations,
            skipped_jobs=self.skipped_jobs,
            skipped_blocks=self.skipped_blocks,
            high_seconds=self.settings.high_seconds,
            low_seconds=self.settings.low_seconds,
        )


__all__ = ["BackpressureSettings", "StoreLatencyMonitor"]
