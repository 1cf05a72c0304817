"""The manager says why a tier's job failed (``kvtier.manager.joblog``).

Before, a failed load (the engine recomputes the blocks) or store was counted
(``promotion_job_failed``, ``cascade_job_failed``) and the tier's reason went to a DEBUG line
for loads and nowhere for stores: a vLLM server's log showed nothing, and CI's run of 77244d3
lost two blocks of a fleet hit from S3 with no way to tell why. Each failure is now a WARNING
naming the tier (index, type, class), the job, how many of its blocks failed and the tier's
words, at the 1st, 10th, 100th... failed job of its kind on a tier.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import LookupResult, Namespace, RequestContext, TieringManager, prefix_keys
from kvtier.keys import KVGeometry
from kvtier.tiers.base import JobResult
from kvtier.tiers.fs import FilesystemTier
from kvtier.tiers.registry import register_tier
from request_flow import store_new
from tier_doubles import ScriptedTier, wait_for_answer

pytestmark = pytest.mark.usefixtures("shm_leak_check")

register_tier("scripted", "tier_doubles:ScriptedTier")
NS = Namespace("job-log-test", KVGeometry.from_block_bytes(64, tokens_per_block=16))
LOGGER = "kvtier.manager.joblog"


def _load_from_tier(mgr: TieringManager, key: bytes, name: str) -> LookupResult:
    """Look ``key`` up (the CPU tier no longer holds it) until the promotion it starts ends."""
    request = RequestContext(name)
    mgr.on_new_request(request)
    assert mgr.lookup(key, request) is LookupResult.HIT_PENDING
    mgr.on_schedule_end()
    answer, _ = wait_for_answer(mgr, key, request, 30.0, 0.001)
    mgr.on_request_finished(request)
    return answer


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_a_load_that_failed_on_a_real_fs_tier_is_logged_with_the_tier_and_its_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "fs"
    spec = {"type": "fs", "root": str(root), "scan_in_background": False}
    rng = np.random.default_rng(5)
    blocks = [prefix_keys(rng.integers(0, 2**31, 1), 1) for _ in range(6)]
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with TieringManager.create(namespace=NS, num_cpu_blocks=2, policy="lru", tiers=[spec]) as mgr:
        for n, keys in enumerate(blocks):
            store_new(mgr, keys, f"store-{n}")
        first = blocks[0][0]
        assert mgr.lookup(first, None) is not LookupResult.HIT  # gone from the CPU tier, in the fs tier
        size = FilesystemTier.bytes_per_block(64)
        values = [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and p.stat().st_size == size]
        assert len(values) == len(blocks)
        for path in values:  # every value's first payload byte (after the header page) flipped
            data = bytearray(path.read_bytes())
            data[4096] ^= 0xFF
            path.write_bytes(bytes(data))
        assert _warnings(caplog) == []
        assert _load_from_tier(mgr, first, "load") is LookupResult.MISS
        (line,) = _warnings(caplog)
        failures = dict(mgr.stats().tier("1:fs").failures)
    assert failures["promotion_job_failed"] == 1
    assert line.startswith("secondary tier #1 (type=fs, class=FilesystemTier): load job ")
    assert ": 1 of 1 blocks failed (the engine recomputes them): " in line
    assert "corrupt" in line.lower()
    assert "[1 failed load jobs on this tier so far" in line


def test_repeated_failures_are_logged_at_the_1st_10th_100th(
    namespace: Namespace, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    tiers: list[dict[str, Any]] = [{"type": "scripted"}]
    with TieringManager.create(namespace=namespace, num_cpu_blocks=4, tiers=tiers, policy="lru") as mgr:
        (tier,) = mgr.tiers
        assert isinstance(tier, ScriptedTier)
        keys = prefix_keys(np.arange(12) + 77, 1)  # twelve one-block prefixes, each loaded once
        for key in keys:
            tier.data[key] = b"v" * mgr.block_bytes
        tier.fail_keys = set(keys)
        for n, key in enumerate(keys):
            assert _load_from_tier(mgr, key, f"load-{n}") is LookupResult.MISS
        loads = _warnings(caplog)
        assert mgr.stats().tier("1:scripted").failures["promotion_job_failed"] == 12
        fresh = prefix_keys(np.arange(16) + 900, 4)
        tier.fail_keys |= set(fresh)
        store_new(mgr, fresh, "store")  # every block of the cascade fails
        stores = _warnings(caplog)[len(loads):]
    assert len(loads) == 2
    assert "[1 failed load jobs" in loads[0] and "[10 failed load jobs" in loads[1]
    assert all(line.startswith("secondary tier #1 (type=scripted, class=ScriptedTier): load job ") for line in loads)
    (store,) = stores
    assert "store job" in store and "4 of 4 blocks failed (not stored there): " in store


class _WordyTier(ScriptedTier):
    """A collaborator double whose failed jobs give a long reason over several lines."""

    tier_type = "job-log-wordy"

    def poll_finished(self) -> list[JobResult]:
        wordy = "line one\nline two\r\n" + "x" * 1000
        return [r if r.success else dataclasses.replace(r, error=wordy) for r in super().poll_finished()]


register_tier("job-log-wordy", f"{__name__}:_WordyTier")


def test_a_tiers_reason_is_logged_on_one_line_and_cut(namespace: Namespace, caplog: pytest.LogCaptureFixture) -> None:
    """Review (2026-12-04): any tier's text (a server's reply) went into the warning whole, newlines
    included: one failure could fill the log or forge lines in it."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with TieringManager.create(namespace=namespace, num_cpu_blocks=4, tiers=[{"type": "job-log-wordy"}],
                               policy="lru") as mgr:  # fmt: skip
        (tier,) = mgr.tiers
        assert isinstance(tier, ScriptedTier)
        (key,) = prefix_keys(np.arange(4) + 5, 4)
        tier.data[key] = b"v" * mgr.block_bytes
        tier.fail_keys = {key}
        assert _load_from_tier(mgr, key, "load") is LookupResult.MISS
        (line,) = _warnings(caplog)
    assert "\n" not in line and "\r" not in line
    assert "(the engine recomputes them): line one line two " + "x" * 282 + " [1 failed load jobs" in line
