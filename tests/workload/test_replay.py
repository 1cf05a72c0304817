"""Metadata-only replay through the real TieringManager."""

from __future__ import annotations

from pathlib import Path

import pytest
from workload_helpers import random_chat_trace

from kvtier.workload.replay import replay_manager, replay_namespace, trace_keys
from kvtier.workload.simulate import lru_hit_rate, unbounded_hit_rate
from kvtier.workload.trace import FlatTrace, read_trace

REAL_TRACE = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "conversation_trace.jsonl"


def test_replay_agrees_with_the_reference_lru(private_shm: Path) -> None:
    trace = random_chat_trace(11, n_requests=400)
    ns = replay_namespace()
    keys = trace_keys(trace, ns)
    for cap in (40, 120):  # larger than the longest request (36 blocks)
        got = replay_manager(keys, cap, namespace=ns, shm_dir=str(private_shm))
        ref = lru_hit_rate(trace, cap)
        assert got.refs == ref.refs
        # The manager does not refresh blocks that follow a miss; the reference LRU does.
        assert abs(got.hits - ref.hits) <= 0.02 * ref.refs
        assert got.tier_hits == {"cpu": got.hits}
    big = replay_manager(keys, 100_000, namespace=ns, shm_dir=str(private_shm))
    assert big.hits == unbounded_hit_rate(trace).hits


def test_replay_with_an_fs_tier_serves_hits_from_disk(tmp_path: Path, private_shm: Path) -> None:
    trace = random_chat_trace(3, n_requests=150)
    ns = replay_namespace()
    keys = trace_keys(trace, ns)
    result = replay_manager(
        keys, 30, namespace=ns, tiers=[{"type": "fs", "root": str(tmp_path)}], shm_dir=str(private_shm)
    )
    assert result.tier_hits["1:fs"] > 0
    # With a lossless fs tier behind it, every reuse is served: the unbounded rate.
    assert result.hits == unbounded_hit_rate(trace).hits


@pytest.mark.skipif(not REAL_TRACE.is_file(), reason="shared Mooncake trace not present")
def test_real_trace_lru_at_9139_blocks(private_shm: Path) -> None:
    trace = FlatTrace.from_requests(read_trace(REAL_TRACE))
    result = replay_manager(trace_keys(trace, replay_namespace()), 9139, policy="lru", shm_dir=str(private_shm))
    assert result.refs == 288500
    assert result.hit_rate == pytest.approx(0.195, abs=0.005)
    assert result.extra["store_rejections"] == 0
