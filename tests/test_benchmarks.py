"""Every benchmark under benchmarks/ still runs: a tiny configuration of each exits 0 and prints
its table (the figures themselves are on the docs' Performance page, from full runs; here only that they come out).

A benchmark that only runs at its default size rots unseen: bench_fs died when a measurement
had more blocks than its tier's store queue holds, as this test's 512 blocks of 16 KiB do.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

RATIO = r"\d+\.\d+"

CASES = {
    "bench_fs": (
        ["--block-bytes", "16384", "--blocks", "512", "--repeat", "1", "--miss-keys", "2000"],
        [rf"store empty tier\s+{RATIO}\s+{RATIO}\s+{RATIO}", rf"store full tier\s+{RATIO}\s+{RATIO}\s+{RATIO}",
         rf"load\s+{RATIO}\s+{RATIO}\s+{RATIO}",
         rf"^lookup MISS \(per key\)\s+\d+\s+\d+\s+{RATIO}\s+\d+\s+{RATIO}$",
         rf"^cold prompt \(per 32-block prompt\)\s+\d+\s+\d+\s+{RATIO}\s+\d+\s+{RATIO}$",
         r"MISS costs with live sharing \(default, journals\) within 2x of sharing off: (MET|MISSED)"],
    ),
    "bench_redis": (
        ["--total-mib", "4", "--rounds", "1", "--sizes-kib", "256"],
        [rf"256KiB\s+store\s+{RATIO}\s+{RATIO}\s+{RATIO}\s+(MET|MISSED)",
         rf"256KiB\s+load\s+{RATIO}\s+{RATIO}\s+{RATIO}\s+(MET|MISSED)"],
    ),
    "bench_redis_send": (
        ["--value-kib", "64", "--values", "8", "--rounds", "1"],
        [rf"^{name}\s+{RATIO}\s+{RATIO}x$" for name in ("raw", "send", r"send\+hash", r"send\+hash-ahead")],
    ),
    "bench_transfer": (
        ["--sizes-kib", "64", "--jobs", "1", "4", "--layouts", "block", "layers", "--budget-mib", "4",
         "--min-reps", "1", "--max-reps", "3", "--no-vllm", "--pool-mib", "16"],
        [rf"64Ki\s+4\s+device->CPU(\s+({RATIO}|n/a)){{6}}\s+(MET|MISSED)", r"\d+ of 8 cells MET"],
    ),
    "bench_manager": (
        ["--blocks", "4000", "--meta-blocks", "4000", "--ops", "512", "--repeat", "1"],
        [r"^lookup HIT\s+\d+\s+" + RATIO, r"metadata \(lru\) at most 256 B/block, full and steady: (MET|MISSED)",
         r"store with eviction \(return-time\) within 1.5x of lru's: (MET|MISSED)",
         r"^decode: one-block stores continuing requests, evicting \(per block\)\s+\d+\s+" + RATIO,
         r"decode stores \(return-time\) within 1.5x of lru's: (MET|MISSED)"],
    ),
    "bench_policy_ops": (
        ["--capacity", "2000", "--ops", "1024", "--repeat", "1"],
        [rf"^{name}(\s+-?\d+){{6}}\s+{RATIO}$" for name in ("lru", "return-time", "arc")]
        + [r"^16-block stores$", r"^decode \(1-block stores\)$"],
    ),
    "bench_fleet": (
        ["--keys", "4000", "--engines", "2", "--queries", "5", "--repeat", "1"],
        [rf"^\s+2048\s+{RATIO}\s+\d+\s+\d+\s+{RATIO}$", r"within 1.5x of each other \(linear\): (MET|MISSED)",
         r"hashing tokens \(sha256 chain\): \d+ ns per block"],
    ),
    "bench_s3": (
        ["--total-mib", "4", "--rounds", "1", "--sizes-mib", "2"],
        [rf"2MiB\s+store\s+{RATIO}\s+{RATIO}\s+{RATIO}", rf"2MiB\s+load\s+{RATIO}\s+{RATIO}\s+{RATIO}"],
    ),
}  # fmt: skip


# bench_manager exits 1 when a target is MISSED, which a tiny run may well be (fixed costs
# weigh more at 4,000 blocks); it must still get through every measurement to say so.
MAY_MISS = {"bench_manager"}


def _run(script: str, args: list[str]) -> str:
    out = subprocess.run([sys.executable, str(BENCHMARKS / f"{script}.py"), *args],
                         capture_output=True, text=True, timeout=300, check=False, cwd=BENCHMARKS.parent)  # fmt: skip
    allowed = {0, 1} if script in MAY_MISS else {0}
    assert out.returncode in allowed, f"{script} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    return out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(CASES))
def test_a_tiny_run_prints_its_table(script: str) -> None:
    if script.startswith("bench_redis") and shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    args, patterns = CASES[script]
    if script in ("bench_manager", "bench_transfer"):  # regions of their own, not in /dev/shm itself
        with tempfile.TemporaryDirectory(prefix="kvt-bench-test-", dir="/dev/shm") as shm:
            stdout = _run(script, [*args, "--shm-dir", shm])
    else:
        stdout = _run(script, args)
    for pattern in patterns:
        assert re.search(pattern, stdout, flags=re.M), f"{script}: no line matching {pattern!r} in:\n{stdout}"


@pytest.mark.slow
def test_bench_vs_vllm_compares_or_says_why_not() -> None:
    stdout = _run("bench_vs_vllm", ["--blocks", "4000", "--ops", "1000", "--rounds", "1"])
    if importlib.util.find_spec("vllm") is None:
        assert "vLLM is not importable here" in stdout, stdout
        return
    for op in ("lookup HIT", "lookup MISS", "store \\+ cascade", "promotion round trip", "prefix scan HIT"):
        row = rf"^{op}\s+[\d,]+\s+[\d,]+\s+[\d,]+\s+{RATIO}x\s+{RATIO}x\s+(MET|MISSED)$"
        assert re.search(row, stdout, flags=re.M), stdout
    assert re.search(r"^\d of 5 operations MET the target: .* within 1.25x of the floor$", stdout, flags=re.M), stdout


@pytest.mark.parametrize("shape", ["stores", "prefill", "decode"])
def test_bench_instructions_child_runs_its_shape(shape: str) -> None:
    # The counted runs themselves (valgrind runs them in the full benchmark; counting them here
    # would cost a minute of CI, so this runs each child once, uncounted).
    with tempfile.TemporaryDirectory(prefix="kvt-bench-instr-test-", dir="/dev/shm") as shm:
        out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_instructions.py"), "--child", "return-time",
                              shape, "64", "2048", shm], capture_output=True, text=True, timeout=300, check=False,
                             cwd=BENCHMARKS.parent)  # fmt: skip
    assert out.returncode == 0, out.stderr


def test_bench_instructions_refuses_a_run_it_cannot_measure() -> None:
    out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_instructions.py"), "--requests", "100"],
                         capture_output=True, text=True, timeout=60, check=False, cwd=BENCHMARKS.parent)  # fmt: skip
    assert out.returncode == 2 and "--requests must be a positive multiple of 64, got 100" in out.stderr
