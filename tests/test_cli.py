"""Every ``kvtier`` command, run in a subprocess, with its output checked."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.policies import DEFAULT_POLICY

REPO = Path(__file__).resolve().parents[1]
REAL_TRACE = REPO / ".." / "shared" / "traces" / "conversation_trace.jsonl"
_SCRIPT = Path(sys.executable).parent / "kvtier"
KVTIER = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "kvtier.cli"]


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    full_env.update(env or {})
    full_env["COLUMNS"] = "160"
    return subprocess.run(
        [*KVTIER, *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO, check=False
    )



TINY_BENCH = [
    "bench", "--sessions", "16", "--max-turns", "4", "--model", "tiny", "--cpu-bytes", "3MiB",
    "--device-blocks", "200", "--prefill-tokens-per-s", "200000", "--no-progress",
]  # fmt: skip


def test_version_and_help() -> None:
    out = run("--version")
    assert out.returncode == 0 and out.stdout.startswith("kvtier ")
    out = run("--help")
    assert out.returncode == 0
    for command in ("bench", "replay", "sweep-shm", "inspect", "config"):
        assert command in out.stdout


def test_bench_prints_tables_and_writes_json_and_plot(tmp_path: Path, private_shm: Path) -> None:
    out = run(*TINY_BENCH, "--shm-dir", str(private_shm), "--fs-root", str(tmp_path / "fs"),
              "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    for text in ("kvtier bench", "hit rate by tier", "device", "cpu", "fs", "bytes moved", "GB/s",
                 "lookup (per block)", "kvtier per engine step", "prefill tokens saved", "errors"):  # fmt: skip
        assert text in out.stdout, text
    assert re.search(r"errors\s*│\s*0\s*│", out.stdout), out.stdout
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["errors"]["total"] == 0
    assert data["verified_blocks"] == data["hits"]["cpu"] + data["hits"]["fs"] > 0
    assert data["requests"] > 6 and data["timeline"]
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(private_shm.iterdir()), "bench left its region behind"
    # The fs tier it left behind is a valid tier: inspect it (next test covers --verify).
    out = run("inspect", str(tmp_path / "fs"), "--verify")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "corrupt:      0" in out.stdout and "kvtier/tiny" in out.stdout


def test_a_bench_shorter_than_the_plot_window_plots_without_a_warning(tmp_path: Path, private_shm: Path) -> None:
    """Regression (review, 2026-12-05): with 3 sessions the rolling window left one point, and
    matplotlib printed a UserWarning about identical x limits on stderr."""
    out = run("bench", "--sessions", "3", "--no-progress", "--shm-dir", str(private_shm), "--fs-root",
              str(tmp_path / "fs"), "--plot", str(tmp_path / "b.png"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr, out.stderr
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_bench_terminated_cleans_up_like_ctrl_c(tmp_path: Path, private_shm: Path, sig: int) -> None:
    """Regression (review, 2026-12-05): SIGTERM (timeout, systemd, CI) killed the bench by the signal's
    default action: exit 143 with its temporary fs directory (up to the fs tier's size) left until
    the next bench or sweep. It now ends the command like Ctrl-C: cleaned up, exit 128 + signal."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["TMPDIR"] = str(scratch)
    args = [*TINY_BENCH, "--shm-dir", str(private_shm)]
    args[args.index("--prefill-tokens-per-s") + 1] = "2000"  # runs long enough to be signalled mid-run
    proc = subprocess.Popen([*KVTIER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not any(p.name.startswith("kvtier-bench-") for p in scratch.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, "the bench made no temporary directory"
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err
    assert f"terminated ({signal.Signals(sig).name})" in err and "Traceback" not in err
    assert list(scratch.iterdir()) == [], "the bench's temporary directory was left behind"
    assert list(private_shm.iterdir()) == []


@contextlib.contextmanager
def _running(command: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """``command`` started with its output piped; killed (and reaped) if still running on the way out."""
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip  (stdin not a terminal: nohup says nothing of it)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_bench_under_nohup_keeps_running_through_a_hangup(private_shm: Path) -> None:
    """Regression (2026-12-05): the command line turned SIGHUP into an interrupt even when the process
    was started with it ignored (``nohup kvtier bench ...``), so closing the terminal still ended
    the run (129). A signal inherited as ignored now stays ignored."""
    args = [*TINY_BENCH, "--shm-dir", str(private_shm), "--no-fs"]
    args[args.index("--prefill-tokens-per-s") + 1] = "20000"  # runs a few seconds
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    with _running(["nohup", *KVTIER, *args], env) as proc:
        ready, _, _ = select.select([proc.stderr], [], [], 60)
        assert ready and proc.stderr is not None and "kvtier bench:" in proc.stderr.readline()
        time.sleep(0.3)
        assert proc.poll() is None, "the bench ended before the hangup"
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "terminated" not in err


def test_bench_serves_metrics_while_running(private_shm: Path) -> None:
    with socket_port() as port:
        pass
    args = [*TINY_BENCH, "--shm-dir", str(private_shm), "--no-fs", "--metrics-port", str(port)]
    args[args.index("--prefill-tokens-per-s") + 1] = "20000"  # runs a few seconds: time to scrape
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    with _running([*KVTIER, *args], env) as proc:
        body = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "kvtier_lookups_total" not in body:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                time.sleep(0.1)
        assert "kvtier_lookups_total" in body
        assert 'kvtier_capacity_bytes{tier="0:primary"}' in body
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert f"http://127.0.0.1:{port}/metrics" in stderr


class socket_port:
    """A free loopback port (closed again on exit, so a child can bind it)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def test_bench_runs_a_config_file_with_env_and_flag_overrides(tmp_path: Path, private_shm: Path) -> None:
    cfg = tmp_path / "kv.yaml"
    cfg.write_text(f"cpu_bytes: 1MiB\nmodel: tiny\npolicy: arc\ntiers:\n  - type: fs\n    root: {tmp_path / 'fs'}\n")
    args = [a for a in TINY_BENCH if a not in ("--model", "tiny", "--cpu-bytes", "3MiB")]
    out = run(*args, "--config", str(cfg), "--cpu-bytes", "3MiB", "--shm-dir", str(private_shm),
              "--json", str(tmp_path / "b.json"), env={"KVTIER_POLICY": "lru"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["options"]["policy"] == "lru"  # env beats the file
    assert data["options"]["cpu_blocks"] == 3 * 2**20 // 16384  # the flag beats the file
    assert data["options"]["tiers"] == [{"type": "fs", "root": str(tmp_path / "fs")}]  # no temp fs tier added
    assert data["geometry"]["bytes_per_block"] == 16384 and data["errors"]["total"] == 0
    assert data["hits"]["fs"] + data["hits"]["cpu"] > 0
    assert any((tmp_path / "fs").iterdir())


def test_bench_bad_size_is_a_usage_error() -> None:
    out = run("bench", "--cpu-bytes", "lots")
    assert out.returncode == 2
    assert "size 'lots' is not understood" in out.stderr


@pytest.mark.skipif(not REAL_TRACE.is_file(), reason="shared Mooncake trace not present")
def test_replay_real_trace_acceptance(tmp_path: Path, private_shm: Path) -> None:
    out = run("replay", str(REAL_TRACE), "--capacity", "9139", "--policy", "lru",
              "--shm-dir", str(private_shm), "--json", str(tmp_path / "r.json"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "12031 requests, 288500 block references" in out.stdout
    assert "unbounded cache prefix-hit rate: 36.6%" in out.stdout
    m = re.search(r"capacity 9139: lru ([\d.]+)%\s+belady ([\d.]+)%\s+unbounded ([\d.]+)%", out.stdout)
    assert m, out.stdout
    kvtier, belady, unbounded = (float(g) for g in m.groups())
    assert kvtier == pytest.approx(19.5, abs=0.5)
    assert unbounded == pytest.approx(36.6, abs=0.05)
    assert kvtier <= belady <= unbounded
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert rows[0]["capacity"] == 9139 and rows[0]["belady"]["hit_rate"] >= rows[0]["kvtier"]["hit_rate"]


def test_replay_capacity_sweep_on_a_small_trace(tmp_path: Path, private_shm: Path) -> None:
    lines = [
        {"timestamp": i, "input_length": 1024, "output_length": 8, "hash_ids": ids}
        for i, ids in enumerate([[0, 1, 2], [0, 1, 3], [4, 5], [0, 1, 2, 6], [4, 5, 7]])
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = run("replay", str(trace), "--capacity", "2,100", "--policy", "lru", "--shm-dir", str(private_shm))
    assert out.returncode == 0, out.stderr
    # 15 refs; unbounded hits: [0,1] + [] + [0,1,2] + [4,5] = 7
    assert "5 requests, 15 block references, 8 distinct blocks" in out.stdout
    assert "unbounded cache prefix-hit rate: 46.7%" in out.stdout
    # Regression (review, 2026-12-03): with one --policy the lines named it "kvtier", not the policy that ran.
    assert "capacity 100: lru 46.67%  belady 46.67%  unbounded 46.67%" in out.stdout
    assert "capacity 2: lru 13.33%  belady 26.67%  unbounded 46.67%" in out.stdout
    out = run("replay", str(trace), "--capacity", "2", "--shm-dir", str(private_shm))  # the default policy
    assert re.search(rf"^capacity 2: {re.escape(DEFAULT_POLICY)} [\d.]+%  belady", out.stdout, re.M), out.stdout
    out = run("replay", str(trace), "--capacity", "0")
    assert out.returncode == 2 and "positive block counts" in out.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": "x"}\n')
    out = run("replay", str(bad))
    assert out.returncode == 2 and f"{bad}:1" in out.stderr


def test_replay_key_seed_draws_other_keys_for_the_same_requests(tmp_path: Path, private_shm: Path) -> None:
    """--key-seed N replays the same requests under keys of another namespace: every block's key
    changes (so does the share return-time samples), LRU's hits do not; 0 is the default."""
    from kvtier.workload.replay import replay_namespace, trace_keys
    from kvtier.workload.synthetic import generate
    from kvtier.workload.trace import FlatTrace

    flat = FlatTrace.from_requests(generate("chat", 50, seed=1))
    default, other = trace_keys(flat, replay_namespace()), trace_keys(flat, replay_namespace(key_seed=1))
    assert trace_keys(flat, replay_namespace(key_seed=0)) == default
    assert not {k for ks in default for k in ks} & {k for ks in other for k in ks}
    assert [len(ks) for ks in default] == [len(ks) for ks in other]
    results = {}
    for seed in ("0", "7"):
        out = run("replay", "--synthetic", "chat", "--requests", "400", "--policy", "return-time", "--capacity", "3%",
                  "--key-seed", seed, "--no-belady", "--shm-dir", str(private_shm),
                  "--json", str(tmp_path / "r.json"))  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert ("key seed 7" in out.stdout) == (seed == "7"), out.stdout
        data = json.loads((tmp_path / "r.json").read_text())
        assert data["key_seed"] == int(seed)
        results[seed] = data["rows"][0]["policies"]
    assert results["0"]["lru"]["prefix_hits"] == results["7"]["lru"]["prefix_hits"] > 0
    out = run("replay", "--synthetic", "chat", "--key-seed", "-1")
    assert out.returncode == 2 and "argument --key-seed: must be at least 0, got -1" in out.stderr


def test_replay_compares_policies_on_a_generated_workload(tmp_path: Path, private_shm: Path) -> None:
    out = run("replay", "--synthetic", "chat", "--requests", "600", "--seed", "3", "--policy", "arc,return-time",
              "--capacity", "2%,150", "--shm-dir", str(private_shm), "--json", str(tmp_path / "r.json"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert re.search(r"synthetic chat \(seed 3\): 600 requests, \d+ block references, (\d+) distinct", out.stdout)
    data = json.loads((tmp_path / "r.json").read_text())
    distinct = data["summary"]["distinct_blocks"]
    assert data["synthetic"] == "chat" and data["policies"] == ["arc", "return-time"]
    assert [row["capacity"] for row in data["rows"]] == [round(0.02 * distinct), 150]
    for row in data["rows"]:
        policies = row["policies"]
        assert list(policies) == ["arc", "return-time", "lru"], "lru runs as the baseline"
        lru = policies["lru"]["hit_rate"]
        for name, result in policies.items():
            assert result["ratio_to_lru"] == pytest.approx(result["hit_rate"] / lru)
            line = (f"capacity {row['capacity']}: {name} {100 * result['hit_rate']:.2f}%  belady "
                    f"{100 * row['belady']['hit_rate']:.2f}%")  # fmt: skip
            if name != "lru":
                assert line in out.stdout
            assert result["hit_rate"] <= row["belady"]["hit_rate"] <= row["unbounded"]["hit_rate"]
        assert row["kvtier"] == policies["arc"]
    for text in ("x LRU", "return-time", "Belady (optimal)"):
        assert text in out.stdout
    assert not list(private_shm.iterdir())


def test_replay_usage_errors_name_the_fix(tmp_path: Path) -> None:
    out = run("replay")
    assert out.returncode == 2 and "give a trace file or --synthetic KIND" in out.stderr
    out = run("replay", str(tmp_path / "t.jsonl"), "--synthetic", "chat")
    assert out.returncode == 2 and "one of them" in out.stderr
    out = run("replay", "--synthetic", "video")
    assert out.returncode == 2 and "invalid choice: 'video'" in out.stderr
    out = run("replay", "--synthetic", "chat", "--policy", "lru,fifo")
    assert out.returncode == 2 and "unknown eviction policy 'fifo'" in out.stderr
    # Regression (2026-12-05): an empty entry was skipped, so a typo ran fewer policies or capacities than asked.
    out = run("replay", "--synthetic", "chat", "--policy", "lru,,arc")
    assert out.returncode == 2 and "--policy 'lru,,arc': an empty entry" in out.stderr
    out = run("replay", "--synthetic", "chat", "--capacity", "1%,,5%")
    assert out.returncode == 2 and "--capacity '1%,,5%': an empty entry" in out.stderr
    out = run("replay", "--synthetic", "chat", "--capacity", "150%")
    assert out.returncode == 2 and "(0%, 100%]" in out.stderr
    out = run("replay", "--synthetic", "chat", "--requests", "0")
    assert out.returncode == 2 and "--requests: must be at least 1, got 0" in out.stderr
    out = run("replay", "--synthetic", "chat", "--json", str(tmp_path / "no" / "r.json"))
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_replay_gives_each_run_its_own_fs_tier(tmp_path: Path, private_shm: Path) -> None:
    """Regression: a second `replay --fs-root DIR` started warm from the first (92.7 % above a 54.5 % ceiling)."""
    args = ["replay", "--synthetic", "rag", "--requests", "150", "--policy", "return-time", "--capacity", "40",
            "--fs-root", str(tmp_path / "fs"), "--shm-dir", str(private_shm)]  # fmt: skip
    for attempt in range(2):  # the second run must start as cold as the first
        out = run(*args, "--json", str(tmp_path / f"r{attempt}.json"), timeout=300)
        assert out.returncode == 0, out.stderr
        assert re.search(r"fs tiers in .*/fs/kvtier-replay-\S+ \(removed after the run\)", out.stderr), out.stderr
        assert not any((tmp_path / "fs").iterdir()), "the run's fs directory was left behind"
        row = json.loads((tmp_path / f"r{attempt}.json").read_text())["rows"][0]
        for result in row["policies"].values():
            # Lossless fs tier behind the CPU tier, started cold: every reuse is served, no more.
            assert result["hit_rate"] == pytest.approx(row["unbounded"]["hit_rate"])
            assert result["tier_hits"]["1:fs"] > 0


def test_sweep_shm_lists_and_removes_only_dead_regions(private_shm: Path) -> None:
    child = textwrap.dedent(
        f"""
        import os, signal
        from kvtier.region import SharedRegion
        region = SharedRegion("dead-owner", 4, 4096, expected_mappers=2, shm_dir={str(private_shm)!r})
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    from kvtier.region import SharedRegion

    live = SharedRegion("live-owner", 4, 4096, expected_mappers=2, shm_dir=private_shm)
    try:
        out = run("sweep-shm", "--shm-dir", str(private_shm))
        assert out.returncode == 0, out.stderr
        assert "dead-owner" in out.stdout and "live-owner" not in out.stdout
        assert "1 stale region(s)" in out.stdout and "use --remove" in out.stdout
        assert any("dead-owner" in p.name for p in private_shm.iterdir())
        out = run("sweep-shm", "--shm-dir", str(private_shm), "--remove")
        assert out.returncode == 0 and "removed" in out.stdout
        assert not any("dead-owner" in p.name for p in private_shm.iterdir())
        assert any("live-owner" in p.name for p in private_shm.iterdir())
        out = run("sweep-shm", "--shm-dir", str(private_shm))
        assert "no stale kvtier regions" in out.stdout
    finally:
        live.close()


def test_inspect_reports_corrupt_entries(tmp_path: Path, private_shm: Path) -> None:
    root = tmp_path / "fs"
    out = run(*TINY_BENCH, "--shm-dir", str(private_shm), "--fs-root", str(root))
    assert out.returncode == 0, out.stderr
    out = run("inspect", str(root))
    assert out.returncode == 0
    m = re.search(r"blocks:\s+(\d+)", out.stdout)
    assert m and int(m.group(1)) > 0
    values = sorted(p for p in root.rglob("*.kv") if p.is_file())
    victim = values[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = run("inspect", str(root), "--verify")
    assert out.returncode == 1
    assert "corrupt:      1" in out.stdout and victim.name in out.stdout
    out = run("inspect", str(root), "--verify", "--json")
    assert out.returncode == 1 and json.loads(out.stdout)["corrupt"] == 1
    out = run("inspect", str(tmp_path / "missing"))
    assert out.returncode == 2 and "missing does not exist" in out.stderr  # (it said "is not a directory")


def test_config_show_resolves_file_env_and_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "kv.yaml"
    cfg.write_text(
        f"policy: arc\nmodel: qwen2.5-0.5b\ntiers:\n  - type: fs\n    root: {tmp_path}\n    max_bytes: 1GiB\n"
    )
    out = run("config", "show", "--config", str(cfg), "--cpu-bytes", "96MiB", env={"KVTIER_CPU_BYTES": "1GiB"})
    assert out.returncode == 0, out.stderr
    assert "bytes per block: 196608 (192.0 KiB)" in out.stdout
    assert "cpu tier:        512 blocks" in out.stdout and "policy arc" in out.stdout
    assert f"{2**30 // (4096 + 196608)} blocks in 1.0 GiB" in out.stdout  # header page + payload
    out = run("config", "show", "--json", env={"KVTIER_NUM_CPU_BLOCKS": "10", "KVTIER_MODEL": "tiny"})
    info = json.loads(out.stdout)
    assert info["cpu"]["blocks"] == 10 and info["bytes_per_block"] == 2 * 2 * 2 * 64 * 2 * 16
    out = run("config", "show", "--cpu-bytes", "4XB")
    assert out.returncode == 2 and "cpu_bytes" in out.stderr and "'4GiB'" in out.stderr
    out = run("config", "show", env={"KVTIER_TIERS": '[{"type": "fs"}]'})
    assert out.returncode == 2 and "tiers[0] (fs)" in out.stderr and "root" in out.stderr


def test_config_reference_and_schema() -> None:
    out = run("config", "reference")
    assert out.returncode == 0
    assert out.stdout == (REPO / "docs" / "configuration.md").read_text()
    out = run("config", "schema")
    assert "cpu_bytes" in json.loads(out.stdout)["$defs"]["KvtierFields"]["properties"]


def test_usage_errors_exit_2() -> None:
    assert run("replay").returncode == 2
    assert run("frobnicate").returncode == 2
    assert run("config").returncode == 2


@pytest.mark.parametrize(
    "args",
    [
        ["config", "show"],
        # Regression: the tables print through rich, whose own broken-pipe handling exited 1 silently.
        TINY_BENCH,
        ["replay", "--synthetic", "chat", "--requests", "100", "--capacity", "5%", "--no-progress"],
    ],
    ids=["config-show", "bench", "replay"],
)
def test_closed_stdout_pipe_is_not_a_traceback(args: list[str], private_shm: Path) -> None:
    """Regression: `kvtier config show | head -2` printed a BrokenPipeError traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["KVTIER_SHM_DIR"] = str(private_shm)
    proc = subprocess.Popen([*KVTIER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first write
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 141, stderr
    assert "Traceback" not in stderr and "error" not in stderr, stderr


def test_bench_with_the_memory_tier(private_shm: Path) -> None:
    out = run(*TINY_BENCH, "--shm-dir", str(private_shm), "--no-fs", "--memory-tier", "64MiB")
    assert out.returncode == 0, out.stderr
    assert "memory" in out.stderr and "cpu -> memory (cascade)" in out.stdout
    assert re.search(r"memory\s*│\s*[1-9]\d*\s*│", out.stdout), "the memory tier served no block"


def test_inspect_refuses_a_namespace_that_is_no_hex(tmp_path: Path) -> None:
    """Regression (review, 2026-12-02): ``inspect --namespace zz`` matched nothing, silently."""
    out = run("inspect", str(tmp_path), "--namespace", "zz")
    assert out.returncode == 2 and "--namespace" in out.stderr and "hex" in out.stderr


def test_inspect_text_reports_a_namespace_directory_that_is_a_link(tmp_path: Path) -> None:
    """Regression (review, 2026-12-03): a namespace directory that is a symbolic link was in
    ``--json``'s ``unsafe_entries`` only; the text report said "0 namespace(s)" and nothing more."""
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    link = root / ("0123456789abcdef" * 2)
    link.symlink_to(outside)
    out = run("inspect", str(root), "--verify")
    assert f"{link}: a symbolic link" in out.stdout, out.stdout
    assert "unsafe entries: 1" in out.stdout and "Traceback" not in out.stderr
    assert link.is_symlink() and list(outside.iterdir()) == []


def test_replay_without_its_input_points_at_its_help(tmp_path: Path) -> None:
    """Regression (docs audit, 2026-12-05): the README says a usage error is one line that points
    at the subcommand's --help; ``kvtier replay`` with no trace and no --synthetic (or both) did not."""
    for argv in (("replay",), ("replay", str(tmp_path / "t.jsonl"), "--synthetic", "chat")):
        out = run(*argv)
        assert out.returncode == 2
        assert out.stderr.count("\n") == 1 and "(see 'kvtier replay --help')" in out.stderr, out.stderr


_SIGNAL_WHILE_PARSING = """
import os, signal, sys
import kvtier.cli as cli
real = cli.build_parser
def build_parser():
    os.kill(os.getpid(), int(sys.argv[1]))
    return real()
cli.build_parser = build_parser
sys.exit(cli.main(["inspect", "/nonexistent"]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_while_the_command_line_is_parsed_ends_with_its_status(sig: int) -> None:
    """Regression (2026-12-06, review): the handlers were in place before the command's ``try``:
    a signal landing while the arguments were parsed escaped ``main`` as a traceback with status 1
    (a Terminated) instead of 143 / 129 / 130."""
    done = subprocess.run([sys.executable, "-c", _SIGNAL_WHILE_PARSING, str(int(sig))], capture_output=True,
                          text=True, timeout=120, start_new_session=True)  # fmt: skip
    assert done.returncode == 128 + sig, done.stderr
    what = "interrupted" if sig == signal.SIGINT else f"terminated ({signal.Signals(sig).name})"
    assert done.stderr.strip() == f"kvtier: {what}"


def test_ctrl_c_with_the_reader_of_standard_error_gone_still_exits_130() -> None:
    """Regression (2026-12-06, review): Ctrl-C in ``kvtier ... 2>&1 | less`` also ends the reader;
    saying "interrupted" then raised BrokenPipeError out of ``main``: status 1. The message is
    dropped, the status stays 130."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is said
    try:
        done = subprocess.run([sys.executable, "-c", _SIGNAL_WHILE_PARSING, str(int(signal.SIGINT))], stdout=write,
                              stderr=write, timeout=120, start_new_session=True)  # fmt: skip
    finally:
        os.close(write)
    assert done.returncode == 130
