"""Claims of the README and docs/ checked as an outside user would, with the real command and API.

Each test names the page and the claim it holds the package to: every bad input is one line
with exit status 2 that names the problem (never an "input no check caught"), and what the
docs say works does.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvtier.errors import ConfigError, KvtierError
from kvtier.metrics import KvtierMetrics

REPO = Path(__file__).resolve().parents[1]
_SCRIPT = Path(sys.executable).parent / "kvtier"
KVTIER: list[str | bytes] = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "kvtier.cli"]
NOT_UTF8 = b"\xff"


def run(*args: str | bytes, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    return subprocess.run([*KVTIER, *args], capture_output=True, text=True, errors="replace", timeout=timeout,
                          env=env, cwd=REPO, check=False)  # fmt: skip


def one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    """The single line a refused command prints: exit status 2, no traceback, no 'please report it'."""
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr and "no check caught" not in out.stderr, out.stderr
    return lines[0]


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


# docs/operations.md "Metrics": metrics.serve(port) serves /metrics; index.md: --metrics-addr ADDR


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
@pytest.mark.parametrize("addr", ["::1", "[::1]"])
def test_metrics_serve_listens_on_an_ipv6_address(addr: str) -> None:
    """An IPv6 address of this machine is served (it was refused as 'give an address of this machine')."""
    metrics = KvtierMetrics()
    port = metrics.serve(0, addr)
    try:
        with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=10) as answer:
            assert b"kvtier_lookup_seconds" in answer.read()
    finally:
        metrics.close()
    assert metrics.port is None


@pytest.mark.parametrize("port", [70000, -1, True])
def test_metrics_serve_refuses_a_port_that_is_no_tcp_port(port: int) -> None:
    """A port outside [0, 65535] is a ConfigError naming it (it was a raw OverflowError), and a bool is
    no port (True served on port 1)."""
    metrics = KvtierMetrics()
    with pytest.raises(ConfigError, match=r"TCP port in \[0, 65535\]"):
        metrics.serve(port)
    assert metrics.port is None


def test_metrics_serve_names_an_address_that_is_not_text() -> None:
    metrics = KvtierMetrics()
    with pytest.raises(KvtierError, match="not text"):
        metrics.serve(0, os.fsdecode(NOT_UTF8))
    assert metrics.port is None


def test_bench_metrics_addr_of_bytes_that_are_not_utf8_is_one_clear_line() -> None:
    out = run("bench", "--metrics-port", "0", b"--metrics-addr", NOT_UTF8, "--model", "tiny", "--sessions", "1",
              "--max-turns", "2", "--no-progress")  # fmt: skip
    assert "--metrics-addr" in one_line_error(out).split("error:", 1)[1]


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_bench_serves_metrics_on_ipv6_loopback_and_says_where() -> None:
    out = run("bench", "--metrics-port", "0", "--metrics-addr", "::1", "--model", "tiny", "--sessions", "1",
              "--max-turns", "2", "--cpu-bytes", "3MiB", "--device-blocks", "200", "--prefill-tokens-per-s", "0",
              "--no-progress", timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "serving Prometheus metrics on http://[::1]:" in out.stderr


# docs/fleet.md "kvtier fleet serve": --engine NAME=ENDPOINT, --replay, --api, --host, --topic,
# --hash-seed, --redis-prefix. README: a usage error is one line naming the flag.


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--engine", b"a=tcp://\xff:5557"),  # reached ZMQ: "an input no check caught"
        ("--engine", b"a\xff=tcp://127.0.0.1:5557"),  # served, answered as a lone surrogate in JSON
        ("--replay", b"a=tcp://\xff:5558"),  # accepted, failed later in the subscriber thread
        ("--api", b"a=http://\xff:8000"),
        ("--host", NOT_UTF8),  # "TypeError: encoding of hostname failed"
        ("--redis-prefix", NOT_UTF8),  # "UnicodeEncodeError ... an input no check caught"
        ("--hash-seed", NOT_UTF8),
        ("--topic", NOT_UTF8),
    ],
)
def test_fleet_serve_refuses_flag_values_that_are_not_utf8(flag: str, value: bytes) -> None:
    args: list[str | bytes] = ["fleet", "serve", "--port", "0"]
    if flag != "--engine":
        args += ["--engine", "a=tcp://127.0.0.1:5557"]
    if flag == "--redis-prefix":
        args += ["--redis", "redis://127.0.0.1:1/0"]
    line = one_line_error(run(*args, flag, value, timeout=30))
    assert f"argument {flag}:" in line and "not UTF-8" in line, line


# docs/index.md: "what the run will hold in memory (the device pool, the CPU tier, the workload's
# prompts and keys, a memory tier) against half of the memory available"


def _memory_tier_need(options: object) -> int:
    from kvtier.workload.bench import BenchOptions

    assert isinstance(options, BenchOptions)
    needs = {need.what: need.bytes for need in options.memory_needs(options.config(None))}
    return needs["memory tier"]


def test_bench_counts_a_memory_tier_once_against_the_memory_available() -> None:
    """--memory-tier 6GiB was counted as 12 GiB (the run's config already holds the flag's tier),
    so a run that fits was refused on a machine with 23 GiB available."""
    from kvtier.config import load_config
    from kvtier.workload.bench import BenchOptions

    tier = {"type": "memory", "max_bytes": 6 << 30}
    assert _memory_tier_need(BenchOptions(model="tiny", extra_tiers=[tier])) == 6 << 30
    base = load_config(env={}, cli={"model": "tiny", "tiers": [{"type": "memory", "max_bytes": 1 << 30}]})
    both = BenchOptions(model="tiny", extra_tiers=[tier], base_config=base, fs=False)
    assert _memory_tier_need(both) == (6 << 30) + (1 << 30)


# docs/policies.md: "--fs-root DIR adds a real fs tier"; index.md: "Every input is checked before any work"


def test_replay_fs_root_not_utf8_is_refused_before_any_work(tmp_path: Path) -> None:
    """A --fs-root of bytes that are not UTF-8 (an fs tier's root is text) is one line naming --fs-root before
    the replay starts; it was refused only by the first replay's tier, naming its internal subdirectory."""
    root = os.fsencode(tmp_path) + b"/kv\xff"
    os.mkdir(root)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}\n')
    line = one_line_error(run("replay", str(trace), "--capacity", "5", "--no-progress", b"--fs-root", root))
    assert "--fs-root" in line and "not UTF-8" in line, line
    assert os.listdir(root) == []
