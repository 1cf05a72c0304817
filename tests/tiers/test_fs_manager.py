"""The filesystem tier inside a real TieringManager (real /dev/shm region, real files):
device -> CPU -> fs -> (CPU reset) -> promotion -> CPU -> device is byte exact, and a new
manager over the same root finds the blocks (warm restart)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.keys import KVGeometry, Namespace, prefix_keys
from kvtier.manager import TieringManager
from kvtier.types import LookupResult, RequestContext

pytestmark = pytest.mark.usefixtures("shm_leak_check")

BLOCK_BYTES = 256 * 1024
NS = Namespace("test/fs-manager", KVGeometry.from_block_bytes(BLOCK_BYTES))


def _manager(root: Path, direct_io: bool | str = "auto") -> TieringManager:
    return TieringManager.create(
        namespace=NS,
        num_cpu_blocks=8,
        tiers=[
            {
                "type": "fs",
                "root": str(root),
                "max_bytes": 64 << 20,
                "read_threads": 2,
                "write_threads": 1,
                "direct_io": direct_io,
            }
        ],
    )


def _settle(mgr: TieringManager, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while mgr.has_pending_work():
        assert time.monotonic() < deadline, "tier jobs did not finish"
        mgr.on_schedule_end()
        time.sleep(0.001)
    mgr.on_schedule_end()


def _promote_and_load(mgr: TieringManager, keys: list[bytes], req: RequestContext) -> np.ndarray:
    """Look keys up step by step until all are CPU HITs, then copy them to a fresh 'device'."""
    deadline = time.monotonic() + 30
    while True:
        answers = [mgr.lookup(k, req) for k in keys]
        if all(a is LookupResult.HIT for a in answers):
            break
        assert LookupResult.MISS not in answers, answers
        assert time.monotonic() < deadline, answers
        mgr.on_schedule_end()
        time.sleep(0.001)
    slots = mgr.prepare_load(keys, req)
    device = np.zeros((len(keys), BLOCK_BYTES), dtype=np.uint8)
    for i, slot in enumerate(slots):
        device[i] = mgr.rows[slot, :BLOCK_BYTES]
    mgr.complete_load(keys, req)
    mgr.on_schedule_end()
    return device


@pytest.mark.parametrize("direct_io", ["auto", False])
def test_round_trip_through_manager_is_byte_exact(tmp_path: Path, direct_io: bool | str) -> None:
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 50_000, 16 * 6)
    keys = prefix_keys(tokens, 16, namespace=NS)
    device = rng.integers(0, 256, (len(keys), BLOCK_BYTES), dtype=np.uint8)
    req = RequestContext("r1")

    mgr = _manager(tmp_path, direct_io)
    try:
        if direct_io is False:
            assert mgr.tiers[0].describe()["direct_io"] is False
        mgr.on_new_request(req)
        plan = mgr.prepare_store(keys, req)
        assert plan is not None and plan.keys_to_store == keys
        for i, slot in enumerate(plan.slots):
            mgr.rows[slot, :BLOCK_BYTES] = device[i]
        mgr.complete_store(keys, req)
        mgr.on_request_finished(req)
        _settle(mgr)
        fs = mgr.tiers[0]
        assert fs.usage().entries == len(keys)

        mgr.reset_cache()
        mgr.rows[:] = 0  # nothing left in the CPU tier to cheat with
        assert all(mgr.primary.lookup(k) is LookupResult.MISS for k in keys)

        req2 = RequestContext("r2")
        mgr.on_new_request(req2)
        back = _promote_and_load(mgr, keys, req2)
        assert np.array_equal(back, device)
        mgr.on_request_finished(req2)
        stats = mgr.stats().as_dict()["tiers"]["1:fs"]
        assert stats["bytes_read"] == len(keys) * BLOCK_BYTES and stats["corrupt_values"] == 0
    finally:
        mgr.shutdown()


@pytest.mark.parametrize("key_kind", ["prefix", "long"])
def test_warm_restart_through_a_new_manager(tmp_path: Path, key_kind: str) -> None:
    """A new manager over the same root finds the blocks; keys longer than 32 bytes (vLLM's
    36-byte offload keys, up to MAX_KEY_BYTES) are stored and named as they are."""
    from kvtier.tiers.format import MAX_KEY_BYTES

    rng = np.random.default_rng(4)
    if key_kind == "prefix":
        keys = prefix_keys(rng.integers(0, 50_000, 16 * 4), 16, namespace=NS)
    else:
        keys = [bytes([i]) * n for i, n in enumerate((36, 33, MAX_KEY_BYTES), start=1)]
    device = rng.integers(0, 256, (len(keys), BLOCK_BYTES), dtype=np.uint8)

    first = _manager(tmp_path)
    try:
        plan = first.prepare_store(keys)
        assert plan is not None
        for i, slot in enumerate(plan.slots):
            first.rows[slot, :BLOCK_BYTES] = device[i]
        first.complete_store(keys)
        _settle(first)
        assert first.tiers[0].stats.stores_failed == 0
    finally:
        first.shutdown()
    assert {p.name for p in tmp_path.rglob("*.kv")} == {k.hex() + ".kv" for k in keys}

    second = _manager(tmp_path)
    try:
        back = _promote_and_load(second, keys, RequestContext("again"))
        assert np.array_equal(back, device)
    finally:
        second.shutdown()
