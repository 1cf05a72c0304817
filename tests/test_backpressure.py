"""Latency-aware backpressure: cascades to a tier whose stores got slow are skipped, loads never."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvtier.tiers.fs as fs_module
from kvtier import LookupResult, Namespace, RequestContext, TieringManager, prefix_keys
from kvtier.backpressure import BackpressureSettings, StoreLatencyMonitor
from kvtier.config import build_manager, load_config
from kvtier.errors import ConfigError
from kvtier.metrics import KvtierMetrics


def test_settings_are_checked() -> None:
    BackpressureSettings(high_seconds=2.0, low_seconds=0.0)
    for bad in ({"high_seconds": 0.0}, {"low_seconds": 1.0}, {"low_seconds": -1.0}, {"warmup_jobs": 0},
                {"smoothing": 0.0}, {"smoothing": 1.5}, {"warmup_jobs": 2.5}):  # fmt: skip
        with pytest.raises(ConfigError, match="backpressure"):
            BackpressureSettings(**bad)  # type: ignore[arg-type]


def test_config_schema_carries_the_settings(private_shm: Path) -> None:
    config = load_config(
        env={"KVTIER_BACKPRESSURE": '{"high_seconds": 4.0}'},
        cli={"model": "tiny", "num_cpu_blocks": 4, "shm_dir": str(private_shm), "backpressure": '{"low_seconds": 2}'},
    )
    assert config.backpressure.settings() == BackpressureSettings(high_seconds=4.0, low_seconds=2.0)
    manager = build_manager(config)
    try:
        assert manager.backpressure == BackpressureSettings(high_seconds=4.0, low_seconds=2.0)
    finally:
        manager.shutdown()
    with pytest.raises(ConfigError, match=r"low_seconds .* must be below high_seconds"):
        load_config(env={}, cli={"backpressure": '{"low_seconds": 3, "high_seconds": 2}'})
    with pytest.raises(ConfigError, match="backpressure"):
        load_config(env={}, cli={"backpressure": '{"high": 3}'})


def test_warm_up_hysteresis_and_probe_admission() -> None:
    monitor = StoreLatencyMonitor(BackpressureSettings(high_seconds=1.0, low_seconds=0.5, warmup_jobs=3,
                                                       smoothing=0.5), "1:fs")  # fmt: skip
    monitor.observe(5.0)
    monitor.observe(5.0)
    assert monitor.average is None and not monitor.active, "no pressure during warm-up"
    monitor.observe(2.0)
    assert monitor.average == pytest.approx(4.0) and monitor.active and monitor.activations == 1
    assert not monitor.admit(blocks=3, stores_in_flight=2)
    assert monitor.admit(blocks=3, stores_in_flight=0), "a probe goes through when nothing is in flight"
    assert (monitor.skipped_jobs, monitor.skipped_blocks) == (1, 3)
    monitor.observe(0.0)  # 2.0
    monitor.observe(0.0)  # 1.0
    monitor.observe(0.5)  # 0.75: between the marks, still active
    assert monitor.active
    monitor.observe(0.0)  # 0.375
    assert not monitor.active and monitor.admit(blocks=1, stores_in_flight=5)
    monitor.observe(0.9)  # 0.6375: between the marks, stays off
    assert not monitor.active
    snap = monitor.snapshot()
    assert snap.activations == 1 and snap.samples == 8 and snap.skipped_jobs == 1


class _SlowDisk:
    """Slows every value write of the fs tier by ``delay`` seconds (an emulated throttled device)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.delay = 0.0
        real = fs_module.write_value

        def slow_write(*args: Any, **kwargs: Any) -> Any:
            if self.delay:
                time.sleep(self.delay)
            return real(*args, **kwargs)

        monkeypatch.setattr(fs_module, "write_value", slow_write)


@pytest.fixture
def slow_fs_manager(
    namespace: Namespace, private_shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[TieringManager, _SlowDisk]]:
    disk = _SlowDisk(monkeypatch)
    manager = TieringManager.create(
        namespace=namespace, num_cpu_blocks=128, shm_dir=private_shm,
        tiers=[{"type": "fs", "root": str(tmp_path / "fs"), "scan_in_background": False}],
        backpressure=BackpressureSettings(high_seconds=0.1, low_seconds=0.05, warmup_jobs=2, smoothing=0.5),
    )
    yield manager, disk
    disk.delay = 0.0
    manager.shutdown()


def _step(mgr: TieringManager, i: int, probe: list[bytes]) -> float:
    """One engine step's kvtier calls (lookups, a device store of two new blocks, step end); their seconds."""
    req = RequestContext(f"r{i}")
    ks = prefix_keys(np.arange(8) + i * 1000, 4)
    start = time.perf_counter()
    for key in probe:
        mgr.lookup(key, req)
    result = mgr.prepare_store(ks, req)
    assert result is not None
    mgr.complete_store(result.keys_to_store, req)
    mgr.on_request_finished(req)
    mgr.on_schedule_end()
    return time.perf_counter() - start


def _drain(mgr: TieringManager, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while mgr.has_pending_work():
        assert time.monotonic() < deadline, "tier jobs still pending"
        mgr.on_schedule_end()
        time.sleep(0.005)


def test_slow_tier_gets_no_new_cascades_while_scheduler_time_stays_flat(
    slow_fs_manager: tuple[TieringManager, _SlowDisk],
) -> None:
    mgr, disk = slow_fs_manager
    probe = prefix_keys(np.arange(16) + 999_000, 4)  # four keys nobody stores: MISS every step
    fast = [_step(mgr, i, probe) for i in range(20)]
    _drain(mgr)
    before = mgr.stats().tier("1:fs")
    assert before.backpressure is not None and not before.backpressure.active
    assert before.written.blocks == 40 and before.backpressure.store_latency_avg is not None

    disk.delay = 0.15  # every block write now takes 150 ms more
    slow: list[float] = []
    i = 20
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        slow.append(_step(mgr, i, probe))
        i += 1
        time.sleep(0.01)  # the engine computes between steps
        bp = mgr.stats().tier("1:fs").backpressure
        assert bp is not None
        if bp.active and bp.skipped_jobs >= 20:
            break
    snap = mgr.stats()
    fs = snap.tier("1:fs")
    assert fs.backpressure is not None and fs.backpressure.active, fs.backpressure
    assert fs.backpressure.store_latency_avg is not None and fs.backpressure.store_latency_avg > 0.1
    assert snap.manager.cascades_skipped >= 40 and fs.backpressure.skipped_blocks >= 40
    # The scheduler never waits for the disk: per-step time stays what it was (a blocked
    # step would take at least one 150 ms write).
    fast_p50, slow_p50 = statistics.median(fast), statistics.median(slow)
    assert slow_p50 < max(10 * fast_p50, 0.01), (fast_p50, slow_p50)
    # Device stores into the CPU tier keep succeeding: skipped cascades pin no rows.
    assert snap.manager.store_rejections == 0
    metrics = KvtierMetrics()
    metrics.update(snap)
    assert 'kvtier_backpressure_active{tier="1:fs"} 1.0' in metrics.render().decode()

    # Loads are never shed: a block only the fs tier still holds is promoted under pressure.
    # The first fast step's block reached the fs tier; more steps (still under pressure) push it
    # out of the 128-block CPU tier. How many steps the slow loop ran depends on how soon the
    # average crossed the high mark, so the eviction is driven here, not assumed.
    on_disk = prefix_keys(np.arange(8) + 0, 4)[0]
    for _ in range(200):
        if on_disk not in mgr.primary:
            break
        _step(mgr, i, probe)
        i += 1
    assert on_disk not in mgr.primary, "200 steps of new blocks did not evict the first step's block"
    req = RequestContext("reader")
    answers = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answers.append(mgr.lookup(on_disk, req))
        if answers[-1] is LookupResult.HIT:
            break
        mgr.on_schedule_end()
        time.sleep(0.005)
    assert answers[0] is LookupResult.HIT_PENDING and answers[-1] is LookupResult.HIT, answers
    assert mgr.stats().tier("1:fs").backpressure.active  # type: ignore[union-attr]

    # The disk recovers: probe cascades come back fast, the average falls, cascades resume.
    disk.delay = 0.0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _step(mgr, i, probe)
        i += 1
        time.sleep(0.005)
        bp = mgr.stats().tier("1:fs").backpressure
        assert bp is not None
        if not bp.active:
            break
    _drain(mgr)
    after = mgr.stats()
    assert after.tier("1:fs").backpressure is not None and not after.tier("1:fs").backpressure.active  # type: ignore[union-attr]
    skipped = after.manager.cascades_skipped
    written = after.tier("1:fs").written.blocks
    for _ in range(3):
        _step(mgr, i, probe)
        i += 1
    _drain(mgr)
    final = mgr.stats()
    assert final.manager.cascades_skipped == skipped
    assert final.tier("1:fs").written.blocks == written + 6


def test_backpressure_can_be_turned_off(namespace: Namespace, private_shm: Path, tmp_path: Path) -> None:
    mgr = TieringManager.create(
        namespace=namespace, num_cpu_blocks=8, shm_dir=private_shm,
        tiers=[{"type": "fs", "root": str(tmp_path), "scan_in_background": False}],
        backpressure=BackpressureSettings(enabled=False),
    )
    try:
        assert mgr.stats().tier("1:fs").backpressure is None
    finally:
        mgr.shutdown()
