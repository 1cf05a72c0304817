"""The real-bytes bench driver, run small."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.keys import chain_ids
from kvtier.metrics import KvtierMetrics
from kvtier.workload.bench import BenchOptions, BlockContent, run_bench
from kvtier.workload.chat import ChatWorkloadSpec

SMALL = ChatWorkloadSpec(
    sessions=16, min_turns=2, max_turns=4, system_tokens=(128, 384), user_tokens=(16, 64), answer_tokens=(16, 96)
)


def small_options(shm: Path, **overrides: object) -> BenchOptions:
    base: dict[str, object] = {
        "shm_dir": str(shm),
        "workload": SMALL,
        "model": "tiny",
        "tokens_per_block": 16,  # 16 KiB blocks
        "cpu_bytes": 2 * 2**20,  # 128 blocks: smaller than the working set
        "device_blocks": 96,
        "prefill_tokens_per_s": 200_000.0,  # paces stores so the fs tier keeps up
    }
    base.update(overrides)
    return BenchOptions(**base)  # type: ignore[arg-type]


def test_block_content_detects_wrong_bytes() -> None:
    content = BlockContent(4096)
    a, b = chain_ids([1, 2])
    row = np.empty(4096, dtype=np.uint8)
    content.fill(a, row)
    assert content.matches(a, row)
    assert not content.matches(b, row)  # another block's bytes
    row[4000] ^= 1
    assert not content.matches(a, row)  # one flipped bit
    content.fill(a, row)
    assert not content.matches(a, np.roll(row, 8))  # shifted copy


def test_simulated_device_pool_is_page_aligned_and_resident() -> None:
    """Regression: numpy's 16-byte offset made the bench's loads (CPU -> device) 1.8x slower than stores."""
    from kvtier.workload.bench import _DevicePool

    pool = _DevicePool(8, 16384)
    assert pool.data.ctypes.data % 4096 == 0 and pool.data.shape == (8, 16384)
    assert not pool.data.any()


def test_bench_moves_and_verifies_real_bytes_through_every_tier(tmp_path: Path, private_shm: Path) -> None:
    metrics = KvtierMetrics()
    progress: list[tuple[int, int]] = []
    result = run_bench(
        small_options(private_shm, fs_root=str(tmp_path / "fs")),
        progress=lambda done, total: progress.append((done, total)),
        metrics=metrics,
    )
    data = result.to_dict()
    assert result.errors == 0, data["errors"]
    assert result.requests == len({r["req_id"] for r in data["timeline"]}) > 10
    assert result.hits["device"] > 0 and result.hits["cpu"] > 0 and result.hits["fs"] > 0
    # Every block that came back from the CPU tier (incl. fs promotions) was checked.
    assert result.blocks_verified == result.hits["cpu"] + result.hits["fs"]
    assert sum(result.hits.values()) + result.computed_blocks == result.block_refs
    assert data["bytes"]["device_to_cpu"] > 0 and data["bytes"]["cpu_to_fs"] > 0 and data["bytes"]["fs_to_cpu"] > 0
    assert data["prefill_tokens_saved"] == sum(result.hits.values()) * 16
    assert data["latency"]["lookup_p50_us"] > 0 and len(result.step_ns) > 0
    assert progress[-1][0] == progress[-1][1] == result.requests
    assert b'kvtier_bytes_total{direction="write",tier="1:fs"}' in metrics.render()
    # The fs tier kept its files: a second run over the same root starts warm.
    warm = run_bench(small_options(private_shm, fs_root=str(tmp_path / "fs"), device_blocks=80))
    assert warm.errors == 0
    first_turns = [r for r in warm.timeline if r.req_id.endswith("-t0")]
    assert sum(r.tier_hits["fs"] for r in first_turns) > 0


def test_bench_without_secondary_tiers(private_shm: Path) -> None:
    result = run_bench(small_options(private_shm, fs=False, cpu_bytes=16 * 2**20))
    assert result.errors == 0
    assert result.tiers == ["cpu"]
    assert result.hits["cpu"] > 0
    assert result.blocks_verified == result.hits["cpu"]


def test_device_pool_too_small_is_explained(private_shm: Path) -> None:
    with pytest.raises(ConfigError, match="raise --device-blocks"):
        run_bench(small_options(private_shm, device_blocks=4, fs=False))


def test_same_seed_same_workload_shape(private_shm: Path) -> None:
    a = run_bench(small_options(private_shm, fs=False))
    b = run_bench(small_options(private_shm, fs=False))
    assert a.block_refs == b.block_refs and a.prompt_tokens == b.prompt_tokens
    # Scheduling order depends on copy timing; the set of requests does not.
    assert sorted(r.req_id for r in a.timeline) == sorted(r.req_id for r in b.timeline)
