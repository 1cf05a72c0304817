"""Helpers shared by the tier benchmarks (imported by scripts run as ``python benchmarks/<name>.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtier.tiers.base import JobResult, SecondaryTier


def interleaved_best(nbytes: int, rounds: int, runs: dict[str, Callable[[], None]]) -> dict[str, float]:
    """GB/s per run, best of ``rounds``; the runs alternate within each round (the order reversed
    every other round) so noise and warm-up hit all alike."""
    best = dict.fromkeys(runs, float("inf"))
    for r in range(rounds):
        order = list(runs.items())
        for name, run in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: nbytes / seconds / 1e9 for name, seconds in best.items()}


def wait_all(tier: SecondaryTier, n: int, timeout: float = 600.0) -> list[JobResult]:
    """Poll ``tier`` until ``n`` job results came in (busy-waits briefly: the poll is the measurement)."""
    out: list[JobResult] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(out)} of {n} tier jobs finished in {timeout}s")
        out.extend(tier.poll_finished())
        if len(out) < n:
            time.sleep(0.0002)
    return out
