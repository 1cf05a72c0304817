"""A policy's own state reaches stats(), the manager's snapshot and the Prometheus metrics."""

from __future__ import annotations

from pathlib import Path

from test_return_time import returning_conversations, run_workload

from kvtier.keys import KVGeometry, Namespace, chain_ids
from kvtier.manager import TieringManager
from kvtier.metrics import KvtierMetrics
from kvtier.policies import LRUPolicy, ReturnTimePolicy
from kvtier.telemetry import ManagerSnapshot, PolicySnapshot
from kvtier.types import RequestContext
from test_metrics import samples


def test_return_time_reports_its_guard() -> None:
    policy = ReturnTimePolicy(64)
    assert policy.stats()["state"] == "learning", "nothing learned yet"
    run_workload(policy, returning_conversations(seed=3, requests=6000))
    stats = policy.stats()
    assert stats["state"] == "ahead", stats
    assert stats["holds_in_use"] == 1.0 and stats["fallbacks"] == 0.0
    assert isinstance(stats["sampled_refs"], float) and stats["sampled_refs"] > 1000
    learned, lru = stats["sampled_hit_rate_learned"], stats["sampled_hit_rate_lru"]
    assert isinstance(learned, float) and isinstance(lru, float)
    assert learned > lru > 0.0, "the miniatures see what the holds gain"
    assert LRUPolicy(8).stats() == {}, "a policy that has nothing to say says nothing"


def test_the_snapshot_and_the_metrics_carry_the_policy_state(private_shm: Path) -> None:
    namespace = Namespace("kvtier/test-policy-stats", KVGeometry.from_block_bytes(64, tokens_per_block=16))
    manager = TieringManager.create(
        namespace=namespace, num_cpu_blocks=64, policy="return-time", shm_dir=str(private_shm), prefault=False
    )
    try:
        for n, ids in enumerate(returning_conversations(seed=2, requests=3000)):
            request = RequestContext(f"r{n}")
            manager.on_new_request(request)
            keys = chain_ids(ids, namespace)
            result = manager.prepare_store(keys, request)
            if result is not None and result.keys_to_store:
                manager.complete_store(result.keys_to_store, request, True)
            manager.on_request_finished(request)
            manager.on_schedule_end()
        snapshot = manager.stats()
    finally:
        manager.shutdown()
    policy = snapshot.cpu.policy
    assert isinstance(policy, PolicySnapshot) and policy.name == "return-time"
    assert policy.state in ("learning", "ahead", "fallen_back")
    assert policy.values["sampled_refs"] > 0
    assert ManagerSnapshot.from_dict(snapshot.as_dict()).cpu.policy == policy, "the dict form keeps it"
    metrics = KvtierMetrics()
    metrics.update(snapshot)
    found = samples(metrics)
    labels = (("policy", "return-time"), ("tier", "0:primary"))
    states = {state: found[("kvtier_policy_state", (*labels[:1], ("state", state), labels[1]))]
              for state in ("learning", "ahead", "fallen_back")}  # fmt: skip
    assert sorted(states.values()) == [0.0, 0.0, 1.0] and states[policy.state] == 1.0
    for cache, name in (("lru", "sampled_hit_rate_lru"), ("learned", "sampled_hit_rate_learned")):
        key = ("kvtier_policy_sampled_hit_ratio", (("cache", cache), *labels))
        assert found[key] == policy.values[name]
    assert found[("kvtier_policy_fallbacks_total", labels)] == policy.values["fallbacks"]
