"""The memory tier's own behaviour (the shared contract is in test_conformance.py), and the
registry path every tier takes: options validated from a config file, built by name."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.config import build_manager, load_config, render_config_reference
from kvtier.errors import ConfigError
from kvtier.keys import KVGeometry, Namespace, chain_ids
from kvtier.testing import new_job, resolve, run_job, wait_results
from kvtier.tiers.base import TierContext
from kvtier.tiers.format import HEADER_SIZE
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.registry import _registered, create_tier, register_tier
from kvtier.types import LookupResult

BLOCK = 16 * 1024
VALUE = HEADER_SIZE + BLOCK
NS = Namespace("memory-test", KVGeometry.from_block_bytes(BLOCK))


@pytest.fixture
def make() -> Iterator[Any]:
    made: list[MemoryTier] = []

    def build(**options: Any) -> tuple[MemoryTier, np.ndarray]:
        rows = np.random.default_rng(len(made)).integers(0, 256, (16, BLOCK), dtype=np.uint8)
        tier = MemoryTier(TierContext(rows, BLOCK, NS), **options)
        made.append(tier)
        return tier, rows

    yield build
    for tier in made:
        tier.shutdown()


def test_capacity_evicts_least_recently_used(make: Any) -> None:
    tier, _ = make(max_bytes=3 * VALUE)
    keys = chain_ids(range(4), NS)
    assert run_job(tier, keys[:3], [0, 1, 2], False, 5).success
    tier.touch([keys[0]], None)  # keys[1] is now the oldest
    assert run_job(tier, keys[3:], [3], False, 5).success
    assert [resolve(tier, k, 1) for k in keys] == [
        LookupResult.HIT, LookupResult.MISS, LookupResult.HIT, LookupResult.HIT,
    ]  # fmt: skip
    usage = tier.usage()
    assert (usage.used_bytes, usage.capacity_bytes, usage.entries) == (3 * VALUE, 3 * VALUE, 3)
    assert tier.stats.evictions == 1
    assert any(e.removed and e.keys == (keys[1],) for e in tier.take_events())


def test_a_value_being_read_is_never_evicted(make: Any) -> None:
    tier, _rows = make(max_bytes=VALUE)
    keys = chain_ids(range(2), NS)
    assert run_job(tier, keys[:1], [0], False, 5).success
    assert tier._admit_load(keys[0])  # a load of keys[0] is in flight
    result = run_job(tier, keys[1:], [1], False, 5)
    assert not result.success and "no room" in (result.error or "")
    assert tier.stats.stores_dropped == 1
    tier._unpin(keys[0])
    assert run_job(tier, keys[1:], [1], False, 5).success
    assert resolve(tier, keys[0], 1) is LookupResult.MISS


def test_options_are_validated_with_clear_errors() -> None:
    rows = np.zeros((2, BLOCK), dtype=np.uint8)
    ctx = TierContext(rows, BLOCK, NS)
    with pytest.raises(ConfigError, match=r"'max_bytes'.*greater than 0"):
        MemoryTier(ctx, max_bytes=0)
    with pytest.raises(ConfigError, match="'io_thread': is not a setting \\(did you mean 'io_threads'"):
        MemoryTier(ctx, io_thread=2)
    tier = create_tier({"type": "memory", "max_bytes": "1MiB", "io_threads": 2}, ctx)
    try:
        assert isinstance(tier, MemoryTier)
        assert tier.describe()["max_bytes"] == 1 << 20 and tier.describe()["io_threads"] == 2
    finally:
        tier.shutdown()


def test_memory_tier_in_a_config_file(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text("model: tiny\nnum_cpu_blocks: 4\ntiers:\n  - type: memory\n    max_bytes: 2MiB\n")
    config = load_config(path, env={})
    assert config.tiers == [{"type": "memory", "max_bytes": 2 << 20}]
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny\ntiers:\n  - type: memory\n    max_byte: 2MiB\n")
    with pytest.raises(ConfigError, match="max_byte"):
        load_config(bad, env={})
    assert "## Tier `memory`" in render_config_reference()


@pytest.fixture
def plugin_registered() -> Iterator[None]:
    register_tier("plugin-mem", "plugin_tier:PluginTier")
    try:
        yield
    finally:
        _registered.pop("plugin-mem", None)


def test_a_tier_registered_from_outside_validates_and_builds_from_a_config_file(
    tmp_path: Path, plugin_registered: None, private_shm: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny\ntiers:\n  - type: plugin-mem\n    label_sufix: x\n")
    with pytest.raises(ConfigError, match="label_sufix"):
        load_config(bad, env={})
    bad.write_text("model: tiny\ntiers:\n  - type: plugin-mem\n    max_bytes: -5\n")
    with pytest.raises(ConfigError, match="max_bytes"):
        load_config(bad, env={})

    good = tmp_path / "kvtier.yaml"
    good.write_text(
        f"model: tiny\nnum_cpu_blocks: 4\nshm_dir: {private_shm}\n"
        "tiers:\n  - type: plugin-mem\n    max_bytes: 1MiB\n    label_suffix: '-x'\n"
    )
    config = load_config(good, env={})
    assert config.tiers == [{"type": "plugin-mem", "max_bytes": 1 << 20, "label_suffix": "-x"}]
    with build_manager(config) as mgr:
        (tier,) = mgr.tiers
        assert type(tier).__name__ == "PluginTier"
        assert tier.describe()["label_suffix"] == "-x" and tier.describe()["max_bytes"] == 1 << 20
        keys = chain_ids(range(2), config.namespace())
        plan = mgr.prepare_store(keys)
        assert plan is not None
        mgr.complete_store(keys)
        deadline = time.monotonic() + 5
        while mgr.has_pending_work():
            assert time.monotonic() < deadline
            mgr.on_schedule_end()
            time.sleep(0.002)
        assert tier.usage().entries == 2


def test_load_of_a_key_evicted_meanwhile_fails_only_that_key(make: Any) -> None:
    tier, rows = make()
    keys = chain_ids(range(2), NS)
    assert run_job(tier, keys, [0, 1], False, 5).success
    tier._drop(keys[1])
    job = new_job(keys, [4, 5], True)
    tier.submit_load(job)
    result = wait_results(tier, {job.job_id}, 5)[job.job_id]
    assert result.succeeded(keys) == [keys[0]] and "no longer held" in (result.error or "")
    assert np.array_equal(rows[4], rows[0])


def test_a_memory_tier_smaller_than_one_value_is_refused() -> None:
    """Regression (2026-12-06, review): ``max_bytes`` below one value was accepted and every store
    then failed with "no room" (the bench reported them as shed with the queue full)."""
    with pytest.raises(ConfigError, match=r"memory tier max_bytes=1 is smaller than one value \(\d+ bytes\)"):
        build_manager(load_config(env={}, cli={"model": "tiny", "num_cpu_blocks": 4,
                                               "tiers": [{"type": "memory", "max_bytes": 1}]}))  # fmt: skip
