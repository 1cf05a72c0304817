"""Regressions from the metrics review (2026-12-06): counters that dipped, failures counted twice,
growing counts exported as gauges, undocumented series, and a shared registry's raw error."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvtier import Namespace, RequestContext, TieringManager, prefix_keys
from kvtier.errors import ConfigError
from kvtier.metrics import KvtierMetrics
from kvtier.tiers.fs import FilesystemTier
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.s3 import S3Tier
from kvtier.types import LookupResult
from test_metrics import samples

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture
def mgr(namespace: Namespace, private_shm: Path) -> Iterator[TieringManager]:
    manager = TieringManager.create(namespace=namespace, num_cpu_blocks=4, shm_dir=private_shm,
                                    tiers=[{"type": "memory"}])  # fmt: skip
    yield manager
    manager.shutdown()


def _settle(mgr: TieringManager) -> None:
    deadline = time.monotonic() + 20
    while mgr.has_pending_work() and time.monotonic() < deadline:
        mgr.on_schedule_end()
        time.sleep(0.002)
    assert not mgr.has_pending_work()


def _store(mgr: TieringManager, keys: list[bytes], request: str) -> None:
    req = RequestContext(request)
    plan = mgr.prepare_store(keys, req)
    assert plan is not None
    mgr.rows[np.asarray(plan.slots), : mgr.block_bytes] = 7
    mgr.complete_store(plan.keys_to_store, req)
    mgr.on_request_finished(req)
    _settle(mgr)


def test_a_tier_counter_read_that_fails_once_keeps_the_last_counters(
    mgr: TieringManager, caplog: pytest.LogCaptureFixture
) -> None:
    """Review t7: one malformed ``stats.extra`` value made every counter of the tier 0 for that
    snapshot (and vLLM's reporter sent the whole total again when it recovered)."""
    tier = mgr.tiers[0]
    tier.stats.lookups_hit = 8
    tier.stats.extra["widgets"] = 3.0
    assert mgr.stats().tier("1:memory").lookups.hit == 8
    tier.stats.extra["note"] = "not a number"  # type: ignore[assignment]
    with caplog.at_level(logging.CRITICAL):
        broken = mgr.stats().tier("1:memory")
    assert broken.lookups.hit == 8 and broken.extra["widgets"] == 3.0 and "note" not in broken.extra
    assert broken.counters["lookups_hit"] == 8
    assert broken.failures["call_error"] == 1  # still counted as the tier's failed call
    del tier.stats.extra["note"]
    tier.stats.lookups_hit = 9
    assert mgr.stats().tier("1:memory").lookups.hit == 9


def test_a_promotion_without_a_free_row_is_not_also_a_rejected_store(mgr: TieringManager) -> None:
    """Review t8: a promotion that found no free CPU row counted as ``promotion_alloc_failed``
    and as ``store_rejected`` both."""
    keys = prefix_keys(np.arange(8 * 16), 16)
    _store(mgr, keys[:4], "a")  # cascaded to the memory tier
    _store(mgr, keys[4:8], "b")  # evicts them from the CPU tier
    loading = RequestContext("load")
    assert all(mgr.lookup(k, loading) is LookupResult.HIT for k in keys[4:8])
    assert mgr.prepare_load(keys[4:8], loading) is not None  # every CPU row pinned
    req = RequestContext("c")
    assert [mgr.lookup(k, req) for k in keys[:4]] == [LookupResult.MISS] * 4
    cpu = mgr.stats().cpu
    assert cpu.failures["promotion_alloc_failed"] == 4
    assert cpu.failures["store_rejected"] == 0
    mgr.complete_load(keys[4:8], loading)
    for request in (loading, req):
        mgr.on_request_finished(request)


@pytest.mark.parametrize("tier", [FilesystemTier, MemoryTier, RedisTier, S3Tier])
def test_the_threaded_tiers_growing_counts_are_declared_counters(tier: type) -> None:
    """Review: ``stores_shed_queue_full`` (every threaded tier) and ``stores_skipped`` (all but
    fs) were undeclared, so exported as gauges though they only grow."""
    for name in ("stores_skipped", "stores_shed_queue_full"):
        assert tier.extra_metrics[name].kind == "counter", (tier.__name__, name)


def test_stores_shed_queue_full_exports_as_a_counter(mgr: TieringManager) -> None:
    metrics = KvtierMetrics()
    metrics.update(mgr)
    got = samples(metrics)
    for name in ("stores_skipped", "stores_shed_queue_full"):
        assert (("kvtier_tier_extra_counter_total", (("name", name), ("tier", "1:memory")))) in got, name
        assert ("kvtier_tier_extra_gauge", (("name", name), ("tier", "1:memory"))) not in got, name


def test_every_policy_value_and_created_series_is_documented(mgr: TieringManager) -> None:
    """Review: ``policy_value{name="hinted_*"}`` and the ``_created`` series were exported, undocumented."""
    metrics = KvtierMetrics()
    metrics.update(mgr)
    text = metrics.render().decode()
    names = set(re.findall(r'^kvtier_policy_value\{[^}]*name="([^"]+)"', text, re.MULTILINE))
    assert {"hinted_ended", "hinted_held", "hinted_late"} <= names
    operations = (DOCS / "operations.md").read_text()
    row = next(line for line in operations.splitlines() if line.startswith("| `policy_value`"))
    assert not {n for n in names if f"`{n}`" not in row}, row
    created = set(re.findall(r"^(kvtier_\w+)_created ", text, re.MULTILINE))
    assert created == {"kvtier_lookup_seconds", "kvtier_scheduler_step_seconds"}
    row = next(line for line in operations.splitlines() if line.startswith("| `lookup_seconds`"))
    assert "`_created`" in row


def test_a_second_kvtier_metrics_on_one_registry_is_a_clear_error() -> None:
    """Review t5: prometheus-client's bare ``Duplicated timeseries``, after half was registered."""
    registry = CollectorRegistry()
    first = KvtierMetrics(registry)
    before = first.render()
    with pytest.raises(ConfigError, match="registry of its own"):
        KvtierMetrics(registry)
    assert first.render() == before  # the registry as it was: nothing of the second is left in it
    first.observe_lookup(1e-5)
    assert b"kvtier_lookup_seconds_count 1.0" in first.render()
