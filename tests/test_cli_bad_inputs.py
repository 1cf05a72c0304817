"""Every ``kvtier`` command against many bad inputs, as a user's subprocess: refused, briefly, cleanly.

Each case runs in its own working directory (with the planted inputs), TMPDIR
and shm directory, four processes at a time, 24 cases per test. For each case:
exit status 2 (usage, configuration or environment), no ``Traceback``, no Rust
``panicked at``, no raw ``[Errno N]``, at most 5 lines on stderr with one
``kvtier ...: error:`` line naming the flag, field or file as typed, and nothing
left behind: no region in a private shm directory or in /dev/shm, nothing in a
private TMPDIR, no new file (no ``*.tmp-*``) next to the planted inputs, which
are all still there, unchanged.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shm_leak_check")]

_SCRIPT = Path(sys.executable).parent / "kvtier"
KVTIER = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "kvtier.cli"]
HUGE = "9" * 401
GOOD_LINE = '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0, 1]}\n'


def _zoo(root: Path) -> None:
    """The hostile inputs the cases name (relative to ``root``, the commands' working directory)."""
    for name in ("fifo", "fifo.yaml", "fifo.jsonl", "fifo.json"):
        os.mkfifo(root / name)
    for name in ("zero.yaml", "zero.jsonl"):
        (root / name).symlink_to("/dev/zero")
    (root / "dangling.yaml").symlink_to("nowhere.yaml")
    (root / "dir").mkdir()
    (root / "dir.yaml").mkdir()
    (root / "plain").write_text("not a directory\n")
    (root / "latin1.yaml").write_bytes(b"model: caf\xe9\n")
    (root / "latin1.json").write_bytes(b'{"model": "caf\xe9"}')
    (root / "latin1.jsonl").write_bytes(GOOD_LINE.encode() + b'{"x": "\xff"}\n')
    (root / "latin1.jsonl.gz").write_bytes(gzip.compress(b"\xfe\xff"))
    (root / "big.yaml").write_text("# padding\n" * 200_000)
    (root / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    (root / "nan.jsonl").write_text(GOOD_LINE + GOOD_LINE.replace('"timestamp": 0', '"timestamp": NaN'))
    (root / "inf.json").write_text('{"shutdown_timeout": Infinity}')
    (root / "int64.jsonl").write_text(GOOD_LINE.replace("[0, 1]", "[18446744073709551616]"))
    (root / "fields.jsonl").write_text('{"timestamp": 0, "hash_ids": [1]}\n')
    (root / "empty.jsonl").write_text("\n\n")
    (root / "trunc.jsonl.gz").write_bytes(gzip.compress(GOOD_LINE.encode() * 100)[:30])
    (root / "list.yaml").write_text("- 1\n- 2\n")
    (root / "unknown.toml").write_text("polcy = 'lru'\n")
    (root / "bad.toml").write_text("policy = \n")
    (root / "conf.ini").write_text("[kvtier]\n")
    (root / "alias.yaml").write_text(
        "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n"
        + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9))
    )
    (root / "tier_bomb.yaml").write_text(
        "kvtier:\n  tiers: &t [[[[[[[[[[1]]]]]]]]]]\n  geometry: {num_layers: *t}\n"
    )
    (root / "broken_plugin.py").write_text("raise RuntimeError('plugin exploded at import')\n")
    (root / "ok.jsonl").write_text(GOOD_LINE * 3)
    (root / "ok.yaml").write_text("model: tiny\n")


CASE_CPU_SECONDS = 5.0
"""CPU seconds (user + system) a refusal may take: it comes before any work (about one on an idle
machine, most of it Python's imports). Measured in CPU time, not wall time: the other test workers
(two vLLM engines among them) share this host's cores, and a CI run saw plain argument refusals of
``kvtier fleet serve`` (0.7-1.8 s idle) take over 30 s of wall time meanwhile."""
CASE_TIMEOUT = 90
"""Wall seconds after which a case counts as hung."""
_CPU_TIMED = (
    "import os, subprocess, sys, time\n"
    "child = subprocess.Popen(sys.argv[3:])\n"
    "deadline = time.monotonic() + float(sys.argv[2])\n"
    "while True:\n"
    "    pid, status, usage = os.wait4(child.pid, os.WNOHANG)\n"
    "    if pid:\n"
    "        break\n"
    "    if time.monotonic() > deadline:\n"
    "        child.kill()\n"
    "        os.wait4(child.pid, 0)\n"
    "        child.returncode = -9\n"
    "        sys.exit(124)\n"
    "    time.sleep(0.02)\n"
    "child.returncode = os.waitstatus_to_exitcode(status)\n"
    "open(sys.argv[1], 'w').write(repr(usage.ru_utime + usage.ru_stime))\n"
    "sys.exit(child.returncode)\n"
)
"""Runs a command (argv[3:]) with the standard streams given, writes its CPU seconds to argv[1];
kills it after argv[2] wall seconds (exit 124, nothing written)."""
BENCH = ["bench", "--no-progress"]
S3 = "http://k:s@127.0.0.1:1/bucket/prefix"
# fmt: off
CASES: list[tuple[str, list[str], dict[str, str]]] = [
    # --- numbers: inf, nan, 1e400, 401 digits, 1e-300, huge counts (flags and environment)
    *[(f"bench {flag} {value[:12]}", [*BENCH, flag, value], {}) for flag in
      ("--sessions", "--min-turns", "--max-turns", "--shared-prompts", "--seed", "--batch-size", "--device-blocks",
       "--tokens-per-block", "--metrics-port")
      for value in ("inf", "nan", "1e400", HUGE, "-1", "1.5", "0x10", "",
                    "99999999999" if flag != "--seed" else "9223372036854775808")],
    *[(f"bench {flag} {value[:12]}", [*BENCH, flag, value], {}) for flag in
      ("--cpu-bytes", "--fs-bytes", "--memory-tier", "--prefill-tokens-per-s")
      for value in ("inf", "nan", "1e400", HUGE, "-1", "1e-300", "99999999999TiB")],
    ("bench --device-blocks 100000000", [*BENCH, "--device-blocks", "100000000"], {}),
    ("bench --device-blocks 16000000", [*BENCH, "--device-blocks", "16000000"], {}),
    ("bench --sessions 1000000", [*BENCH, "--sessions", "1000000", "--max-turns", "500"], {}),
    ("bench --shared-prompts 100001", [*BENCH, "--shared-prompts", "100001"], {}),
    ("bench --cpu-bytes 1PiB", [*BENCH, "--cpu-bytes", "1PiB"], {}),
    ("bench --memory-tier 1PiB", [*BENCH, "--no-fs", "--memory-tier", "1PiB"], {}),
    *[(f"env {name}={value[:12]}", [*BENCH], {name: value}) for name, value in
      (("KVTIER_SHUTDOWN_TIMEOUT", "inf"), ("KVTIER_SHUTDOWN_TIMEOUT", "nan"), ("KVTIER_SHUTDOWN_TIMEOUT", "1e400"),
       ("KVTIER_SHUTDOWN_TIMEOUT", "1e300"), ("KVTIER_SHUTDOWN_TIMEOUT", "-1"), ("KVTIER_CPU_BYTES", HUGE),
       ("KVTIER_CPU_BYTES", "1e400"), ("KVTIER_NUM_CPU_BLOCKS", HUGE), ("KVTIER_GEOMETRY", '{"num_layers": 1e400}'),
       ("KVTIER_BACKPRESSURE", '{"high_seconds": Infinity}'), ("KVTIER_BACKPRESSURE", '{"warmup_jobs": 1e30}'),
       ("KVTIER_TIERS", '[{"type": "memory", "max_bytes": 1e400}]'),
       ("KVTIER_POLICY", "broken_plugin:X"))],
    *[(f"config show {flag} {value[:12]}", ["config", "show", flag, value], {}) for flag, value in
      (("--shutdown-timeout", "inf"), ("--shutdown-timeout", "1e400"), ("--cpu-bytes", HUGE),
       ("--num-cpu-blocks", "1e400"), ("--geometry", '{"head_dim": NaN}'),
       ("--backpressure", '{"low_seconds": -1e-300}'),
       ("--cpu-bytes", "-0"), ("--num-cpu-blocks", "99999999999999999999"))],
    *[(f"replay {flag} {value[:12]}", ["replay", "--synthetic", "chat", flag, value], {}) for flag, value in
      (("--requests", "1e400"), ("--requests", HUGE), ("--requests", "100000000"), ("--seed", "-1"),
       ("--capacity", "inf%"), ("--capacity", "nan%"), ("--capacity", "1e400"), ("--capacity", HUGE),
       ("--capacity", "99999999999"), ("--capacity", "268435456"), ("--capacity", "0"), ("--limit", HUGE),
       ("--store-chunk", "0"), ("--capacity", "1e-300%"))],
    ("inspect --sample 1e400", ["inspect", S3, "--sample", "1e400"], {}),
    # --- files a user names
    *[(f"{' '.join(cmd)} {name}", [*cmd, name], {}) for cmd in
      (["config", "show", "--config"], [*BENCH, "--config"], ["sweep", "--config"], ["sweep-shm", "--config"])
      for name in ("fifo.yaml", "zero.yaml", "dangling.yaml", "dir.yaml", "latin1.yaml", "latin1.json", "big.yaml",
                   "deep.json", "list.yaml", "unknown.toml", "bad.toml", "conf.ini", "alias.yaml",
                   "tier_bomb.yaml", "missing.yaml", "plain")],
    ("config show --config inf.json", ["config", "show", "--config", "inf.json"], {}),
    *[(f"replay {name}", ["replay", name], {}) for name in
      ("fifo", "fifo.jsonl", "zero.jsonl", "dir", "latin1.jsonl", "latin1.jsonl.gz", "deep.jsonl", "nan.jsonl",
       "int64.jsonl", "fields.jsonl", "empty.jsonl", "trunc.jsonl.gz", "missing.jsonl")],
    # --- modules named by import path
    ("bench --policy broken_plugin:X", [*BENCH, "--policy", "broken_plugin:X"], {}),
    ("replay --policy broken_plugin:X", ["replay", "--synthetic", "chat", "--policy", "lru,broken_plugin:X"], {}),
    ("config show --tiers broken", ["config", "show", "--tiers", '[{"type": "broken_plugin:X"}]'], {}),
    ("config show --policy .rel:X", ["config", "show", "--policy", ".rel:X"], {}),
    # --- output paths
    *[(f"{cmd[0]} {flag} {path}", [*cmd, flag, path], {}) for cmd in
      ([*BENCH, "--model", "tiny"], ["replay", "--synthetic", "chat", "--requests", "50"])
      for flag in ("--json", "--plot") if not (cmd[0] == "replay" and flag == "--plot")
      for path in ("fifo", "dir", "missing/out.json", "plain/out.json", "x" * 300 + ".json",
                   "/dev/zero/x")],
    ("bench --json - --plot -", [*BENCH, "--json", "-", "--plot", "-"], {}),
    ("bench --plot out.txt", [*BENCH, "--plot", "out.txt"], {}),
    ("bench --plot noext", [*BENCH, "--plot", "noext"], {}),
    ("bench --json ok.yaml --config ok.yaml", [*BENCH, "--config", "ok.yaml", "--json", "ok.yaml"], {}),
    ("replay --json ok.jsonl", ["replay", "ok.jsonl", "--json", "ok.jsonl"], {}),
    ("config reference --output fifo", ["config", "reference", "--output", "fifo"], {}),
    ("config reference --output dir", ["config", "reference", "--output", "dir"], {}),
    ("config reference --output missing/x", ["config", "reference", "--output", "missing/x.md"], {}),
    # --- no flag silently ignored
    ("inspect --remove-corrupt", ["inspect", "dir", "--remove-corrupt"], {}),
    ("inspect s3 --remove-corrupt", ["inspect", S3, "--remove-corrupt"], {}),
    ("inspect --region on a dir", ["inspect", "dir", "--region", "eu-west-1"], {}),
    ("inspect --sample on a dir", ["inspect", "dir", "--sample", "3"], {}),
    ("inspect redis://", ["inspect", "redis://127.0.0.1:6379/0"], {}),
    ("inspect gs://", ["inspect", "gs://bucket/prefix"], {}),
    ("inspect file://", ["inspect", "file:///tmp"], {}),
    ("inspect ''", ["inspect", ""], {}),
    ("inspect a file", ["inspect", "plain"], {}),
    ("bench --no-fs --fs-root", [*BENCH, "--no-fs", "--fs-root", "dir"], {}),
    ("bench --no-fs --fs-bytes", [*BENCH, "--no-fs", "--fs-bytes", "1GiB"], {}),
    ("bench --fs-bytes with config tiers", [*BENCH, "--fs-bytes", "1GiB"],
     {"KVTIER_TIERS": '[{"type": "memory", "max_bytes": 1048576}]'}),
    ("bench --metrics-addr alone", [*BENCH, "--metrics-addr", "0.0.0.0"], {}),
    ("replay trace --requests", ["replay", "ok.jsonl", "--requests", "5"], {}),
    ("replay trace --seed", ["replay", "ok.jsonl", "--seed", "5"], {}),
    ("replay trace and --synthetic", ["replay", "ok.jsonl", "--synthetic", "chat"], {}),
    ("replay --fs-root a file", ["replay", "--synthetic", "chat", "--requests", "20", "--fs-root", "plain"], {}),
    *[(f"{cmd[0]} {flag} ''", [*cmd, flag, ""], {}) for cmd, flags in
      (([*BENCH], ("--json", "--plot", "--redis", "--s3", "--fs-root", "--config", "--model", "--policy", "--shm-dir",
                   "--metrics-addr")),
       (["replay", "--synthetic", "chat"], ("--json", "--fs-root", "--shm-dir", "--policy")),
       (["sweep"], ("--shm-dir", "--tmp-dir", "--config")), (["sweep-shm"], ("--shm-dir", "--config")),
       (["inspect", "dir"], ("--namespace",)), (["config", "show"], ("--cpu-bytes", "--policy", "--tiers")),
       (["config", "reference"], ("--output",)))
      for flag in flags],
    ("replay ''", ["replay", ""], {}),
    ("bench --fs-root a file", [*BENCH, "--fs-root", "plain"], {}),
    ("bench --fs-root a FIFO", [*BENCH, "--fs-root", "fifo"], {}),
    ("bench --fs-root /dev/null", [*BENCH, "--fs-root", "/dev/null"], {}),
    ("bench --shm-dir a file", [*BENCH, "--shm-dir", "plain"], {}),
    ("bench --shm-dir missing", [*BENCH, "--shm-dir", "missing"], {}),
    ("replay --shm-dir a FIFO", ["replay", "--synthetic", "chat", "--shm-dir", "fifo"], {}),
    ("sweep --tmp-dir a FIFO", ["sweep", "--tmp-dir", "fifo"], {}),
    ("sweep-shm --shm-dir a file", ["sweep-shm", "--shm-dir", "plain"], {}),
    ("no command", [], {}),
    ("unknown command", ["frobnicate"], {}),
    ("config without a verb", ["config"], {}),
    ("fleet without a verb", ["fleet"], {}),
    ("fleet serve without --engine", ["fleet", "serve", "--port", "0"], {}),
    *[(f"fleet serve {flag} {value}", ["fleet", "serve", "--engine", "a=tcp://127.0.0.1:1", "--port", "0", flag, value],
       {}) for flag, value in (("--request-timeout", "nan"), ("--request-timeout", "inf"), ("--lag-seconds", HUGE),
                               ("--max-body", "-1"), ("--max-concurrent", "1e400"), ("--port", "99999"),
                               ("--redis", "redis://u:secret@h:99999"), ("--redis-prefix", "a*b"),
                               ("--tokens-per-hash", "0"))],
    ("fleet serve --engine a=http://x", ["fleet", "serve", "--engine", "a=http://x", "--port", "0"], {}),
    ("replay --fs-blocks 4GiB", ["replay", "--synthetic", "chat", "--fs-root", "dir", "--fs-blocks", "4GiB"], {}),
    ("replay --fs-blocks 0.00001%", ["replay", "--synthetic", "chat", "--requests", "50", "--fs-root", "dir",
                                     "--fs-blocks", "0.00001%"], {}),
    ("replay --admission without --fs-root", ["replay", "--synthetic", "chat", "--admission", "learned"], {}),
    ("replay --hints on a trace", ["replay", "ok.jsonl", "--hints"], {}),
    ("replay --json and --plot one file", ["replay", "--synthetic", "chat", "--json", "x.png", "--plot", "x.png"], {}),
    ("unknown flag", [*BENCH, "--frobnicate"], {}),
]
# fmt: on


def _snapshot(work: Path) -> dict[str, tuple[int, int, int]]:
    return {p.name: (p.lstat().st_mode, p.lstat().st_size, p.lstat().st_ino) for p in work.iterdir()}


def _check_case(case: tuple[str, list[str], dict[str, str]], root: Path) -> str | None:
    """Run one case in its own working directory, TMPDIR and shm directory; what went wrong, or None."""
    name, args, extra_env = case
    work, tmp = root / "work", root / "tmp"
    work.mkdir(parents=True)
    tmp.mkdir()
    _zoo(work)
    shm = Path(tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm"))
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "AWS_"))}
        path = os.pathsep.join(p for p in (str(work), os.environ.get("PYTHONPATH", "")) if p)
        env.update({"TMPDIR": str(tmp), "KVTIER_SHM_DIR": str(shm), "PYTHONPATH": path, "COLUMNS": "200"})
        before = _snapshot(work)
        cpu_file = root / "cpu-seconds"
        timed = [sys.executable, "-c", _CPU_TIMED, str(cpu_file), str(CASE_TIMEOUT), *KVTIER, *args]
        out = subprocess.run(timed, cwd=work, env={**env, **extra_env}, capture_output=True, text=True,
                             timeout=CASE_TIMEOUT + 60, check=False)  # fmt: skip
        if not cpu_file.exists():
            return f"{name}: no answer within {CASE_TIMEOUT} s (a hang)\n    stderr: {out.stderr[-600:]!r}"
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        problems = []
        cpu = float(cpu_file.read_text())
        if cpu > CASE_CPU_SECONDS:
            problems.append(f"{cpu:.1f} CPU seconds (work done before the refusal)")
        if out.returncode != 2:
            problems.append(f"exit {out.returncode}")
        if "Traceback" in out.stderr or "panicked at" in out.stderr or "[Errno" in out.stderr:
            problems.append("a traceback, a panic or raw [Errno N] text")
        if not 1 <= len(lines) <= 5:
            problems.append(f"{len(lines)} lines on stderr")
        errors = [line for line in lines if line.startswith("kvtier") and ": error: " in line]
        if len(errors) != 1:
            problems.append("not one 'kvtier ...: error: ...' line")
        if _snapshot(work) != before:
            problems.append("the planted inputs changed or something was left next to them")
        if any(shm.iterdir()) or any(tmp.iterdir()):
            problems.append("a region or a temporary directory was left behind")
        if problems:
            return f"{name}: {'; '.join(problems)}\n    stderr: {out.stderr[-600:]!r}"
        return None
    finally:
        shutil.rmtree(shm, ignore_errors=True)


CHUNK = 24
"""Cases per test (four processes at a time): each test stays far below pytest's 300 s timeout."""


@pytest.mark.parametrize(
    "first", range(0, len(CASES), CHUNK), ids=[f"{CASES[i][0]} and {len(CASES[i:i + CHUNK]) - 1} more"
                                               for i in range(0, len(CASES), CHUNK)],
)  # fmt: skip
def test_every_command_refuses_every_bad_input_briefly_and_cleanly(tmp_path: Path, first: int) -> None:
    """Cases ``first`` to ``first + CHUNK``, each a real ``kvtier`` process in its own directories."""
    chunk = CASES[first : first + CHUNK]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda ic: _check_case(ic[1], tmp_path / str(ic[0])), enumerate(chunk)))
    failures = [r for r in results if r is not None]
    assert not failures, f"{len(failures)} of {len(chunk)} cases:\n" + "\n".join(failures)


def test_the_sweep_covers_every_command() -> None:
    from kvtier.cli import build_parser

    commands = set()
    for action in build_parser()._actions:
        if isinstance(getattr(action, "choices", None), dict):
            commands |= set(action.choices)
    covered = {args[0] for _, args, _ in CASES if args}
    assert commands <= covered, commands - covered
    assert {"show", "reference"} <= {args[1] for _, args, _ in CASES if args[:1] == ["config"] and len(args) > 1}
    assert len(CASES) >= 250, len(CASES)
    json.dumps(CASES)  # plain data
