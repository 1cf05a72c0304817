"""Regressions of the fleet index and subscriber found by the eleventh review wave (2026-12-06)."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest

from kvtier.engine_events import ControlRecord, TierInfo
from kvtier.fleet import FleetIndex, MemoryMasks
from kvtier.fleet.records import Kind, WireBatch, WireEvent
from kvtier.fleet.subscriber import EngineEndpoint

NOW = time.time()


@pytest.mark.parametrize("url", ["tcp://[::1:5557", "tcp://[::1]]:5557", "tcp://::1]:5557", "tcp://[::1]x:5557",
                                 "tcp://[10.0.0.1]:5557", "tcp://[]:5557", "tcp://host[1]:5557"])  # fmt: skip
def test_a_malformed_ipv6_tcp_endpoint_is_refused_by_name(url: str) -> None:
    """Regression (review wave 11): ``tcp://[::1:5557`` and ``tcp://[::1]]:5595`` passed the
    endpoint check (host and port split at the last colon) and ZMQ took them without a word:
    the subscriber then waited for the engine for ever."""
    with pytest.raises(ValueError, match=r"engine e: events endpoint .* has a malformed host"):
        EngineEndpoint("e", url)
    with pytest.raises(ValueError, match=r"engine e: replay endpoint .* has a malformed host"):
        EngineEndpoint("e", "tcp://127.0.0.1:5557", replay=url)


@pytest.mark.parametrize("url", ["tcp://[::1]:5557", "tcp://[fe80::1%eth0]:5557", "tcp://10.0.0.1:5557",
                                 "tcp://engine-a.local:5557", "tcp://[::ffff:10.0.0.1]:5557"])  # fmt: skip
def test_well_formed_tcp_endpoints_still_pass(url: str) -> None:
    assert EngineEndpoint("e", url).events == url


def test_kvtier_fleet_serve_refuses_a_malformed_ipv6_endpoint_in_one_line() -> None:
    cli = [sys.executable, "-m", "kvtier.cli", "fleet", "serve", "--port", "0", "--engine", "a=tcp://[::1:5557"]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "engine a" in lines[0] and "tcp://[::1:5557" in lines[0], lines


def _record(op: str, seq: int, tiers: tuple[TierInfo, ...], **fields: Any) -> WireEvent:
    record = ControlRecord(op, "e", "s1", seq, NOW, tiers, {"tokens_per_hash": 16}, **fields)
    return WireEvent(Kind.CONTROL, control=ControlRecord.decode(record.encode()))


def _open_snapshots(index: FleetIndex, tiers: tuple[TierInfo, ...], keys: tuple[int, ...]) -> None:
    """Engine ``a`` says hello, then sends part 0 of a complete snapshot of each tier, never its last."""
    index.apply("a", WireBatch(NOW, [_record("hello", 0, tiers)], 0))
    for seq, tier in enumerate(tiers, 1):
        snapshot = {"tier": tier.label, "part": 0, "last": False, "complete": True, "reason": "request"}
        index.apply("a", WireBatch(NOW, [_record("snapshot", seq, tiers, **snapshot),
                                         WireEvent(Kind.STORED, keys, "STORAGE", tier.label)], 0))  # fmt: skip


def _held(index: FleetIndex) -> int:
    return sum(len(listed) for _, listed in index._sweeps.values())


def test_snapshot_sweeps_of_one_store_under_many_labels_share_one_bound() -> None:
    """Regression (review wave 11): the keys a complete shared-store snapshot lists were bounded
    per (engine, tier label): an engine naming one store under 63 labels, each with a snapshot
    that never ends, held 63 times ``max_keys`` keys in the index's memory."""
    tiers = tuple(TierInfo(f"{i}:fs", "fs", "STORAGE", "shared", "one-store") for i in range(1, 9))
    index = FleetIndex(["a"], MemoryMasks(max_keys=100))
    _open_snapshots(index, tiers, tuple(range(90)))
    assert _held(index) <= 100
    # the second label of the store is not followed: one store is one location
    assert list(index.engine("a").tiers) == ["1:fs"] and index.engine("a").skipped >= 1


def test_snapshot_sweeps_of_distinct_stores_share_one_bound_and_the_overflow_is_counted() -> None:
    tiers = tuple(TierInfo(f"{i}:fs", "fs", "STORAGE", "shared", f"store-{i}") for i in range(1, 9))
    index = FleetIndex(["a"], MemoryMasks(max_keys=100))
    _open_snapshots(index, tiers, tuple(range(60)))
    assert _held(index) <= 100 and index._listed_held == _held(index)
    engine = index.engine("a")
    assert engine.skipped >= 1 and engine.status == "partial"
    # a snapshot that ends gives its keys back to the budget
    index.apply("a", WireBatch(NOW, [_record("snapshot", 20, tiers, tier="8:fs", part=0, last=True, complete=True,
                                             reason="request")], 0))  # fmt: skip
    assert index._listed_held == _held(index)
