"""Helpers shared by the benchmarks (imported by scripts run as ``python benchmarks/<name>.py``)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from kvtier.keys import BlockKey
from kvtier.tiers.base import JobResult, SecondaryTier, TransferJob


def random_keys(n: int, seed: int) -> list[BlockKey]:
    """``n`` random 32-byte keys (distinct with overwhelming probability), without hashing per key."""
    buf = np.random.default_rng(seed).bytes(32 * n)
    return [buf[i : i + 32] for i in range(0, 32 * n, 32)]


def make_keys(tag: str, n: int) -> list[BlockKey]:
    """``n`` random keys, the same for the same ``tag`` (keys of different tags never meet)."""
    return random_keys(n, int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "little"))


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


def submit_in_jobs(
    tier: SecondaryTier,
    keys: Sequence[BlockKey],
    job_blocks: int,
    job_ids: Iterator[int],
    *,
    load: bool,
    first_row: int,
) -> int:
    """Submit ``keys[i]`` <-> CPU row ``first_row + i`` as jobs of ``job_blocks`` keys; returns how many jobs."""
    submit = tier.submit_load if load else tier.submit_store
    jobs = 0
    for i in range(0, len(keys), job_blocks):
        chunk = keys[i : i + job_blocks]
        submit(TransferJob(next(job_ids), chunk, np.arange(first_row + i, first_row + i + len(chunk)), load))
        jobs += 1
    return jobs


def check_succeeded(results: Sequence[JobResult]) -> None:
    """Raise naming the first errors if any job failed (a benchmark of failed jobs measures nothing)."""
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} tier jobs failed: {failed[:3]}")
