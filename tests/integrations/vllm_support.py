"""Helpers for the end-to-end tests on the real vLLM engine (imported only where vLLM is installed).

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor
``uni``) with float32 and 32-token blocks: bf16 crashes vLLM's CPU attention on
this machine kind, and in-process mode starts in seconds and lets the tests
reach the connector's manager and worker directly.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
BLOCK_TOKENS = 32
MAX_TOKENS = 12


def set_engine_env() -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)


@contextlib.contextmanager
def engine(model_dir: Path, kv_transfer_config: dict[str, Any] | None = None) -> Iterator[Any]:
    """An in-process ``LLM``; shut down (connector included) on exit."""
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    llm = LLM(
        model=str(model_dir),
        max_model_len=2048,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        block_size=BLOCK_TOKENS,
        distributed_executor_backend="uni",
        kv_transfer_config=kv_transfer_config,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def generate(llm: Any, prompts: Sequence[list[int]]) -> list[tuple[tuple[int, ...], int]]:
    """Greedy outputs: per prompt, (generated token ids, number of cached prompt tokens)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [(tuple(o.outputs[0].token_ids), int(o.num_cached_tokens or 0)) for o in outs]


def offloading_manager(llm: Any) -> Any:
    """The connector's scheduler-side OffloadingManager (our adapter)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager


def offloading_worker(llm: Any) -> Any:
    """The connector's worker-side OffloadingWorker (our copier wrapper)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().connector_worker.worker


def settle(llm: Any, rounds: int = 40) -> None:
    """Step tiny unrelated requests until deferred stores and tier cascades have finished."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    mgr = offloading_manager(llm)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for i in range(rounds):
        llm.generate([TokensPrompt(prompt_token_ids=[3 + i % 4, 4, 5])], params, use_tqdm=False)
        if i >= 1 and not mgr.has_pending_work():
            return
    raise AssertionError(f"kvtier still has pending work after {rounds} steps: {mgr.kvtier_stats()}")


def expected_cached(prompt: Sequence[int]) -> int:
    """Prompt tokens a full prefix hit covers: whole blocks, leaving at least one token to compute."""
    return (len(prompt) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
