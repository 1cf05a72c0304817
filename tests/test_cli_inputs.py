"""Every input of the ``kvtier`` command is honoured or refused clearly, in a subprocess, by exit code and message.

Exit status for every command: 0 success, 1 verification failed, 2 bad usage,
configuration or environment. One test per way a new user got it wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.cli import build_parser
from kvtier.errors import ConfigError
from kvtier.workload.bench import TEMP_DIR_PREFIX, BenchOptions

REPO = Path(__file__).resolve().parents[1]
_SCRIPT = Path(sys.executable).parent / "kvtier"
KVTIER = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "kvtier.cli"]
TINY = ["--sessions", "6", "--max-turns", "3", "--model", "tiny", "--cpu-bytes", "3MiB", "--device-blocks", "200",
        "--prefill-tokens-per-s", "0", "--no-progress"]  # fmt: skip


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.pop("COLUMNS", None)
    env.update(extra or {})
    return env


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVTIER, *args], capture_output=True, text=True, timeout=timeout, env=_env(env),
                          cwd=REPO, check=False)  # fmt: skip


def one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    """The single line a refused command prints (no traceback, nothing else)."""
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    return lines[0]


def dead_port() -> int:
    """A loopback port nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------- --help of every command


def _commands() -> list[list[str]]:
    out: list[list[str]] = []

    def walk(parser: object, prefix: list[str]) -> None:
        for action in getattr(parser, "_actions", []):
            choices = getattr(action, "choices", None)
            if isinstance(choices, dict):
                for name, sub in choices.items():
                    out.append([*prefix, name])
                    walk(sub, [*prefix, name])

    walk(build_parser(), [])
    return out


def test_every_command_is_found() -> None:
    names = {" ".join(c) for c in _commands()}
    expected = {"bench", "replay", "sweep", "sweep-shm", "inspect", "config", "config show", "config reference",
                "config schema"}  # fmt: skip
    assert expected <= names, names


@pytest.mark.parametrize("command", _commands(), ids=" ".join)
def test_help_of_every_command(command: list[str]) -> None:
    out = run(*command, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: kvtier {' '.join(command)}"), out.stdout[:200]
    assert out.stderr == ""


# --------------------------------------------------------------------------- bad numbers: refused at parse time


def test_zero_batch_size_is_refused_at_once_not_a_hang() -> None:
    """Regression: `kvtier bench --batch-size 0` admitted nothing and waited forever."""
    started = time.monotonic()
    out = run("bench", "--batch-size", "0", timeout=60)
    assert out.returncode == 2, out.stderr
    assert "argument --batch-size: must be at least 1, got 0" in out.stderr
    assert time.monotonic() - started < 30
    with pytest.raises(ConfigError, match="batch_size must be a positive integer"):
        BenchOptions(batch_size=0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokens-per-block", "0"], "argument --tokens-per-block: must be at least 1, got 0"),
        (["--sessions", "0"], "argument --sessions: must be at least 1"),
        (["--min-turns", "0"], "argument --min-turns: must be at least 1"),
        (["--max-turns", "-2"], "argument --max-turns: must be at least 1"),
        (["--shared-prompts", "-1"], "argument --shared-prompts: must be at least 0"),
        (["--seed", "-1"], "argument --seed: must be at least 0"),
        (["--device-blocks", "0"], "argument --device-blocks: must be at least 1"),
        (["--prefill-tokens-per-s", "-5"], "argument --prefill-tokens-per-s: must be a finite number"),
        (["--prefill-tokens-per-s", "nan"], "argument --prefill-tokens-per-s: must be a finite number"),
        (["--sessions", "many"], "argument --sessions: 'many' is not an integer"),
        (["--cpu-bytes", "0"], "argument --cpu-bytes: size '0' must be positive"),
        (["--fs-bytes", "0"], "argument --fs-bytes: size '0' must be positive"),
        (["--metrics-port", "70000"], "argument --metrics-port: must be a TCP port"),
        (["--min-turns", "5", "--max-turns", "3"], "--min-turns 5 is above --max-turns 3"),
    ],
)
def test_zero_or_negative_workload_numbers_are_refused_naming_the_flag(args: list[str], message: str) -> None:
    """Regression: `--tokens-per-block 0` silently ran with the default."""
    out = run("bench", *args, timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


# --------------------------------------------------------------------------- bad config values: one line


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--policy", "foo"], ["'policy'", "CLI flag --policy", "'foo'", "'arc'", "'lru'"]),
        (["--model", "unknown"], ["model 'unknown'", "qwen2.5-0.5b", "CLI flag --model"]),
        (["--redis", "http://x"], ["url", "redis://"]),
    ],
)
def test_bad_config_values_are_one_line_naming_field_value_and_choices(args: list[str], fragments: list[str]) -> None:
    """Regression: `--policy foo` / `--model unknown` printed a raw pydantic traceback and exited 1."""
    line = one_line_error(run("bench", *args, timeout=60))
    assert line.startswith("kvtier bench: error: ")
    for fragment in fragments:
        assert fragment in line, line


# ------------------------------------------------------------------ file < env < flags, with or without --config


def test_environment_is_honoured_without_a_config_file(tmp_path: Path, private_shm: Path) -> None:
    """Regression: `KVTIER_CPU_BYTES=64MiB kvtier bench` ignored the variable unless --config was given."""
    out = run("bench", *[a for a in TINY if a not in ("--cpu-bytes", "3MiB")], "--shm-dir", str(private_shm),
              "--no-fs", "--json", str(tmp_path / "b.json"),
              env={"KVTIER_CPU_BYTES": "2MiB", "KVTIER_POLICY": "arc"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["options"]["cpu_bytes"] == 2 * 2**20 and data["options"]["policy"] == "arc"
    assert "cpu_bytes (environment variable KVTIER_CPU_BYTES)" in out.stderr
    # A flag beats the environment, the environment beats the file.
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("policy: lru\ncpu_bytes: 1MiB\nmodel: tiny\n")
    out = run("bench", *TINY, "--shm-dir", str(private_shm), "--no-fs", "--config", str(cfg),
              "--json", str(tmp_path / "c.json"), env={"KVTIER_POLICY": "arc", "KVTIER_CPU_BYTES": "2MiB"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["options"]["policy"] == "arc" and data["options"]["cpu_bytes"] == 3 * 2**20


def test_config_show_names_each_values_source(tmp_path: Path) -> None:
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("policy: arc\nmodel: tiny\n")
    out = run("config", "show", "--config", str(cfg), "--cpu-bytes", "8MiB", env={"KVTIER_MODEL": "qwen2.5-0.5b"})
    assert out.returncode == 0, out.stderr
    assert re.search(rf"policy\s+= \"arc\"\s+\(file {re.escape(str(cfg))}\)", out.stdout), out.stdout
    assert re.search(r"model\s+= \"qwen2.5-0.5b\"\s+\(environment variable KVTIER_MODEL\)", out.stdout)
    assert re.search(r"cpu_bytes\s+= 8388608\s+\(CLI flag --cpu-bytes\)", out.stdout)
    assert re.search(r"shm_dir\s+= \"/dev/shm\"\s+\(default\)", out.stdout)
    info = json.loads(run("config", "show", "--json", env={"KVTIER_POLICY": "arc"}).stdout)
    assert info["sources"]["policy"] == "environment variable KVTIER_POLICY" and info["sources"]["tiers"] == "default"


def test_sweep_commands_honour_the_environment(private_shm: Path) -> None:
    out = run("sweep-shm", env={"KVTIER_SHM_DIR": str(private_shm)})
    assert out.returncode == 0 and f"no stale kvtier regions in {private_shm}" in out.stdout
    line = one_line_error(run("sweep-shm", env={"KVTIER_SHM_DIR": str(private_shm / "missing")}))
    assert "is not a directory" in line


def test_replay_honours_the_environment_and_checks_its_output(tmp_path: Path, private_shm: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 8,
                                         "hash_ids": [0, 1, i]}) + "\n" for i in range(2, 6)))  # fmt: skip
    env = {"KVTIER_POLICY": "arc", "KVTIER_SHM_DIR": str(private_shm)}
    out = run("replay", str(trace), "--capacity", "10", env=env)
    assert out.returncode == 0, out.stderr
    assert "(policy arc)" in out.stdout
    out = run("replay", str(trace), "--capacity", "10", "--policy", "lru", env=env)
    assert out.returncode == 0 and "(policy lru)" in out.stdout
    line = one_line_error(run("replay", str(trace), "--json", str(tmp_path / "missing" / "r.json"), env=env))
    assert "--json" in line and "does not exist" in line
    out = run("replay", str(trace), "--store-chunk", "0", env=env)  # argparse: usage, then the error
    assert out.returncode == 2 and "argument --store-chunk: must be at least 1, got 0" in out.stderr
    out = run("replay", str(trace), "--capacity", "10", "--store-chunk", "1", "--json", str(tmp_path / "r.json"),
              env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "stores of at most 1 blocks" in out.stdout
    assert json.loads((tmp_path / "r.json").read_text())["store_chunk"] == 1


# --------------------------------------------------------------------------- outputs checked before the run


def test_plot_without_matplotlib_is_refused_before_the_run(tmp_path: Path, private_shm: Path) -> None:
    """Regression: the whole bench ran, then a ModuleNotFoundError traceback, exit 1."""
    code = "import sys; sys.modules['matplotlib'] = None; from kvtier.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run(
        [sys.executable, "-c", code, "bench", *TINY, "--shm-dir", str(private_shm), "--plot", str(tmp_path / "p.png")],
        capture_output=True, text=True, timeout=60, env=_env(), check=False,
    )  # fmt: skip
    line = one_line_error(out)
    assert "--plot needs matplotlib" in line and "pip install 'kvtier[plot]'" in line
    assert out.stdout == "" and not any(tmp_path.iterdir())


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_outputs_into_a_missing_or_unusable_directory_are_refused_before_the_run(
    flag: str, tmp_path: Path, private_shm: Path
) -> None:
    """Regression: a traceback after the whole run."""
    name = "out.json" if flag == "--json" else "out.png"
    args = ["bench", *TINY, "--shm-dir", str(private_shm)]
    line = one_line_error(run(*args, flag, str(tmp_path / "missing" / name)))
    assert f"{flag} " in line and "does not exist" in line
    (tmp_path / "file").write_text("")
    line = one_line_error(run(*args, flag, str(tmp_path / "file" / name)))
    assert "does not exist" in line
    line = one_line_error(run(*args, flag, str(tmp_path)))
    assert "is a directory" in line
    if os.getuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        line = one_line_error(run(*args, flag, str(locked / name)))
        assert "is not writable" in line
    line = one_line_error(run("config", "reference", "--output", str(tmp_path / "missing" / "c.md")))
    assert "--output" in line


# --------------------------------------------------------------------------- an unreachable tier


@pytest.mark.slow
def test_unreachable_redis_is_named_its_drops_labelled_and_strict_refuses(tmp_path: Path, private_shm: Path) -> None:
    """Regression: one warning, a full run, exit 0, and the dropped writes labelled "write queue full"."""
    url = f"redis://127.0.0.1:{dead_port()}/0"
    args = ["bench", *TINY, "--shm-dir", str(private_shm), "--no-fs", "--redis", url]
    out = run(*args, "--json", str(tmp_path / "b.json"))
    assert out.returncode == 0, out.stderr
    assert "tier 1:redis is unreachable: circuit breaker open (" in out.stderr
    assert "Connection refused" in out.stderr and "--strict makes this an error" in out.stderr
    assert re.search(r"redis tier\s+│\s+unreachable", out.stdout), out.stdout
    assert "redis stores dropped (out of service)" in out.stdout
    assert "queue full" not in out.stdout
    health = json.loads((tmp_path / "b.json").read_text())["tier_health"]["redis"]
    assert health["stores_dropped_out_of_service"] > 0 and health["stores_shed_queue_full"] == 0
    started = time.monotonic()
    line = one_line_error_after_warnings(run(*args, "--strict"))
    assert "tier 1:redis is unreachable" in line and "--strict" in line
    assert time.monotonic() - started < 30


def one_line_error_after_warnings(out: subprocess.CompletedProcess[str]) -> str:
    """The error line of a refused run (the header and the tier's own warning may come before it)."""
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and out.stdout == ""
    errors = [line for line in out.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, out.stderr
    return errors[0]


# --------------------------------------------------------------------------- kill -9 leaves no temp dir for good


def _killed_bench(tmp: Path, private_shm: Path) -> Path:
    """Start `kvtier bench` with TMPDIR=tmp, kill -9 it once its fs tier holds values; its temp dir."""
    before = set(tmp.iterdir())
    args = ["bench", "--sessions", "400", "--model", "tiny", "--cpu-bytes", "1MiB", "--no-progress",
            "--shm-dir", str(private_shm)]  # fmt: skip
    proc = subprocess.Popen([*KVTIER, *args], env=_env({"TMPDIR": str(tmp)}), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not any(d.is_dir() and any(d.rglob("*.kv")) for d in set(tmp.iterdir()) - before):
            assert time.monotonic() < deadline and proc.poll() is None, "the bench never wrote to its fs tier"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    (new,) = set(tmp.iterdir()) - before
    assert new.name.startswith(TEMP_DIR_PREFIX)
    return new


@pytest.mark.slow
def test_a_killed_bench_temp_dir_is_swept_by_kvtier_sweep_or_the_next_start(tmp_path: Path, private_shm: Path) -> None:
    """Regression: kill -9 during `kvtier bench` left its temporary fs tier in /tmp forever."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp)}
    stale = _killed_bench(tmp, private_shm)
    out = run("sweep", "--shm-dir", str(private_shm), env=env)
    assert out.returncode == 0, out.stderr
    assert "1 stale bench dir(s)" in out.stdout and str(stale) in out.stdout and "use --remove" in out.stdout
    assert stale.is_dir()  # listed, not removed
    out = run("sweep", "--remove", "--shm-dir", str(private_shm), env=env)
    assert out.returncode == 0 and "removed" in out.stdout
    assert not stale.exists()
    # The next start sweeps too, and removes its own directory at the end.
    stale = _killed_bench(tmp, private_shm)
    out = run("bench", *TINY, "--shm-dir", str(private_shm), env=env)
    assert out.returncode == 0, out.stderr
    assert not stale.exists() and not any(tmp.iterdir())


# --------------------------------------------------------------------------- terminal vs pipe


def test_piped_bench_output_fits_80_columns_without_wrapping_a_phrase(private_shm: Path) -> None:
    out = run("bench", *TINY, "--shm-dir", str(private_shm))
    assert out.returncode == 0, out.stderr
    for line in out.stdout.splitlines():
        assert len(line) <= 80, line
    labels = ("loaded blocks verified byte-exact", "blocks (prompt refs / computed)", "device pool / cpu tier",
              "prefill tokens saved", "hit rate by tier (share of prompt blocks)", "kvtier per engine step")
    for label in labels:
        assert any(label in line for line in out.stdout.splitlines()), label
    assert "requests" not in out.stderr.replace("kvtier bench:", "")  # no progress bar when piped
    assert "\x1b[" not in out.stdout + out.stderr


@pytest.mark.slow
def test_progress_bar_on_a_terminal(private_shm: Path) -> None:
    import pty

    main, child = pty.openpty()
    args = [a for a in TINY if a != "--no-progress"]
    args[args.index("--prefill-tokens-per-s") + 1] = "20000"  # a few seconds: time for the bar to draw
    proc = subprocess.Popen([*KVTIER, "bench", *args, "--shm-dir", str(private_shm)], stdin=child, stdout=child,
                            stderr=child, env=_env({"TERM": "xterm", "COLUMNS": "100"}), close_fds=True)  # fmt: skip
    os.close(child)
    chunks = []
    try:
        while True:
            try:
                data = os.read(main, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
    finally:
        assert proc.wait(timeout=120) == 0
        os.close(main)
    text = b"".join(chunks).decode(errors="replace")
    assert re.search(r"requests .*\d+/\d+", text), text[-2000:]
    assert "kvtier bench" in text


# --------------------------------------------------------------------------- issue 20: untrusted input, per class


@pytest.fixture
def no_kvtier_env(monkeypatch: pytest.MonkeyPatch, private_shm: Path) -> Path:
    for name in [n for n in os.environ if n.startswith("KVTIER_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KVTIER_SHM_DIR", str(private_shm))
    return private_shm


def refused_here(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``kvtier argv`` in this process; the one error line of its exit status 2."""
    from kvtier.cli import main

    def fds() -> set[str]:
        out = set()
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
                out.add(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        return out

    before = fds()
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    assert fds() <= before, f"descriptors left open: {fds() - before}"
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, (code, captured.out[-500:], captured.err)
    assert "Traceback" not in captured.err and len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.usefixtures("no_kvtier_env")
@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["bench", "--no-fs", "--fs-root", "/tmp/x"], ["--no-fs", "--fs-root", "drop one"]),
        (["bench", "--no-fs", "--fs-bytes", "2GiB"], ["--no-fs", "--fs-bytes"]),
        (["bench", "--fs-bytes", "2GiB", "--memory-tier", "1MiB", "--config", "{cfg}"],
         ["--fs-bytes", "configuration names its own tiers", "--fs-root"]),
        (["bench", "--metrics-addr", "0.0.0.0"], ["--metrics-addr needs --metrics-port"]),
        (["bench", "--fs-root", ""], ["argument --fs-root: empty value ''"]),
        (["bench", "--redis", " "], ["argument --redis: empty value ' '"]),
        (["bench", "--s3", ""], ["argument --s3: empty value"]),
        (["bench", "--json", ""], ["argument --json: empty value"]),
        (["replay", "--synthetic", "chat", "--fs-root", ""], ["argument --fs-root: empty value"]),
        (["replay", "{trace}", "--requests", "10"], ["--requests", "--synthetic", "not a trace"]),
        (["replay", "{trace}", "--seed", "1"], ["--seed", "--synthetic"]),
        (["inspect", "{dir}", "--remove-corrupt"], ["--remove-corrupt", "add --verify"]),
        (["inspect", "s3://bucket/p", "--remove-corrupt"], ["--remove-corrupt", "--verify or --sample N"]),
        (["inspect", "{dir}", "--region", "eu-west-1"], ["--region applies to S3 prefixes"]),
        (["inspect", "s3://bucket/p", "--verify", "--sample", "3"], ["--verify", "--sample N", "give one of them"]),
        (["inspect", "redis://127.0.0.1:6379/0"], ["inspect reads an fs tier directory or an S3 prefix", "redis://"]),
        (["inspect", "gs://bucket/prefix"], ["gs://", "s3://bucket/prefix"]),
        (["inspect", "HTTP+unix://x"], ["http+unix://"]),
        (["inspect", ""], ["the directory or S3 prefix is empty"]),
        (["config", "show", "--shm-dir", ""], ["argument --shm-dir: empty value"]),
        (["config", "reference", "--output", ""], ["argument --output: empty value"]),
        (["sweep", "--tmp-dir", ""], ["argument --tmp-dir: empty value"]),
    ],
)
def test_no_flag_is_silently_ignored(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], fragments: list[str]
) -> None:
    """Regression: `--fs-root ''` printed "fs (temp dir)" and ran without an fs tier; `inspect DIR --region`,
    `--remove-corrupt` without `--verify` and `--no-fs --fs-root` were ignored without a word."""
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("tiers:\n  - type: memory\n    max_bytes: 1MiB\n")
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n')
    values = {"{cfg}": str(cfg), "{trace}": str(trace), "{dir}": str(tmp_path)}
    line = refused_here(capsys, *[values.get(a, a) for a in argv])
    for fragment in fragments:
        assert fragment.lower() in line.lower(), line


@pytest.mark.usefixtures("no_kvtier_env")
@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["bench", "--device-blocks", "100000000"], "argument --device-blocks: must be at most 16777216"),
        (["bench", "--device-blocks", "9" * 401], "argument --device-blocks: a number of 401 digits"),
        (["bench", "--sessions", "1e400"], "argument --sessions: '1e400' is not an integer"),
        # Regression (review, 2026-12-06): int() reads other scripts' digits ('١٢' was 12).
        (["bench", "--sessions", "\u0661\u0662"], "argument --sessions: '\u0661\u0662' is not an integer"),
        (["bench", "--metrics-port", "\uff11\uff12"], "argument --metrics-port: '\uff11\uff12' is not an integer"),
        (["bench", "--seed", str(2**63)], "argument --seed: must be at most"),
        (["bench", "--prefill-tokens-per-s", "1e-300"], "argument --prefill-tokens-per-s: must be a finite number"),
        (["bench", "--prefill-tokens-per-s", "inf"], "argument --prefill-tokens-per-s"),
        (["bench", "--cpu-bytes", "9" * 401], "(401 characters) is above the largest size"),
        (["bench", "--sessions", "1000000", "--max-turns", "1000"], "lower --sessions/--max-turns"),
        (["bench", "--device-blocks", "16000000"], "device pool 2.9 TiB (--device-blocks)"),
        (["replay", "--synthetic", "chat", "--requests", "1e400"], "argument --requests"),
        (["replay", "--synthetic", "chat", "--capacity", "nan%"], "not a percentage like 5%"),
        (["replay", "--synthetic", "chat", "--capacity", "0.0000001%", "--requests", "20"], "less than one block"),
        (["replay", "--synthetic", "chat", "--capacity", "200000000"], "CPU tier metadata"),
        (["inspect", "s3://bucket/p", "--sample", "9" * 50], "argument --sample: a number of 50 digits"),
        (["config", "show", "--shutdown-timeout", "inf"], "'shutdown_timeout' (from CLI flag --shutdown-timeout)"),
    ],
)
def test_numbers_out_of_range_are_refused_naming_the_flag_before_any_allocation(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    """Regression: `--device-blocks 100000000` was a traceback (MemoryError); 60000 silently took 11 GiB."""
    line = refused_here(capsys, *argv)
    assert fragment in line, line


def test_outputs_are_written_in_place_and_dash_is_stdout(tmp_path: Path, private_shm: Path) -> None:
    """Regression: --json wrote PATH.tmp-PID and renamed it over PATH (a symlink or /dev/null was replaced)."""
    target = tmp_path / "ref.md"
    target.write_text("old")
    (tmp_path / "link.md").symlink_to("ref.md")
    inode = target.stat().st_ino
    assert run("config", "reference", "--output", str(tmp_path / "link.md")).returncode == 0
    assert (tmp_path / "link.md").is_symlink() and target.stat().st_ino == inode
    assert target.read_text() == (REPO / "docs" / "configuration.md").read_text()
    null = os.stat("/dev/null")
    out = run("config", "reference", "--output", "/dev/null")
    assert out.returncode == 0 and os.stat("/dev/null").st_rdev == null.st_rdev
    args = ["replay", "--synthetic", "chat", "--requests", "40", "--capacity", "20", "--shm-dir", str(private_shm)]
    out = run(*args, "--json", "-")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["rows"][0]["capacity"] == 20, "stdout must hold the JSON alone"
    assert "prefix-hit rate vs CPU capacity" in out.stderr
    fifo = tmp_path / "r.fifo"
    os.mkfifo(fifo)
    line = one_line_error(run(*args, "--json", str(fifo)))
    assert "is a FIFO that no process is reading" in line
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    try:
        out = run(*args, "--json", str(fifo))
        assert out.returncode == 0, out.stderr
        assert json.loads(reader.communicate(timeout=60)[0])["synthetic"] == "chat"
    finally:
        reader.kill()
        reader.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.md", "r.fifo", "ref.md"], "a temp file was left"


def test_bench_names_the_policy_that_runs_as_its_help_says(tmp_path: Path, private_shm: Path) -> None:
    """Regression: `bench --help` said the default policy is lru while return-time ran, and the output
    never named the policy."""
    from kvtier.config import KvtierConfig

    help_text = " ".join(run("bench", "--help").stdout.split())
    m = re.search(r"--policy NAME CPU tier eviction policy \(default ([\w:.-]+)", help_text)
    assert m, help_text
    assert m.group(1) == KvtierConfig.model_fields["policy"].default
    out = run("bench", *TINY, "--shm-dir", str(private_shm), "--no-fs", "--json", str(tmp_path / "b.json"))
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "b.json").read_text())["options"]["policy"] == m.group(1)
    assert re.search(rf"policy \(cpu tier\)\s+│\s+{m.group(1)}\s+│", out.stdout), out.stdout
    assert f"policy {m.group(1)}, device pool 200 blocks (3.1 MiB)" in out.stderr
    out = run("bench", *TINY, "--shm-dir", str(private_shm), "--no-fs", "--policy", "arc")
    assert re.search(r"policy \(cpu tier\)\s+│\s+arc\s+│", out.stdout) and "policy arc," in out.stderr


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs (root only): a file system that fills up."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True,
                          check=False)  # fmt: skip
    if made.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_exit_1_says_which_tier_failed_and_why(full_disk: Path, private_shm: Path) -> None:
    """Regression: `errors 1` and exit status 1 with no line saying what failed (a full fs tier)."""
    out = run("bench", *TINY, "--shm-dir", str(private_shm), "--fs-root", str(full_disk / "fs"))
    assert out.returncode == 1, out.stderr
    said = [line for line in out.stderr.splitlines() if line.startswith("kvtier bench: ")]
    assert any(re.fullmatch(r"kvtier bench: \d+ tier job\(s\) failed .*no wrong bytes\)", line) for line in said), said
    assert f"kvtier bench: fs tier failed: no space left under {full_disk / 'fs'}" in out.stderr, out.stderr
    assert "[Errno" not in out.stderr


def test_error_lines_name_each_cause_without_errno_text() -> None:
    from kvtier.workload.bench_result import BenchResult

    result = BenchResult(options={}, geometry={}, tiers=["cpu", "fs", "s3"])
    assert result.error_lines() == []
    result.verify_failures, result.tier_failures, result.promotion_failures = 2, 3, 1
    result.tier_errors = {"fs": "store failed: [Errno 13] Permission denied: '/kv/ab'", "s3": "request timed out"}
    lines = result.error_lines()
    assert lines[0].startswith("2 loaded block(s) had wrong bytes")
    assert lines[1] == ("3 tier job(s) failed; 1 block(s) could not be loaded back (computed again instead; "
                        "no wrong bytes)")  # fmt: skip
    assert lines[2:] == ["fs tier failed: store failed: Permission denied: '/kv/ab'",
                         "s3 tier failed: request timed out"]  # fmt: skip


# --------------------------------------------------------------------------- messages name what was given


@pytest.mark.parametrize("args", [["--bogus"], ["-v", "--bogus"], ["-x"], ["--vers"]])
def test_an_unknown_option_before_any_subcommand_is_named(args: list[str]) -> None:
    """Regression (review, 2026-12-03): ``kvtier --bogus`` said only that a subcommand is required."""
    line = one_line_error(run(*args))
    assert f"unrecognized arguments: {args[-1]}" in line and "kvtier --help" in line, line


def test_bench_names_the_flag_that_set_the_geometry(private_shm: Path) -> None:
    """Regression (review, 2026-12-03): ``--tokens-per-block`` was reported as "CLI flag --geometry",
    a flag ``kvtier bench`` does not have."""
    out = run("bench", *TINY, "--tokens-per-block", "32", "--shm-dir", str(private_shm))
    assert out.returncode == 0, out.stderr
    assert "geometry (CLI flag --tokens-per-block)" in out.stderr and "--geometry" not in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("env", "flag", "where"),
    [
        ({"KVTIER_CPU_BYTES": "64TiB"}, [], "KVTIER_CPU_BYTES"),
        ({}, ["--cpu-bytes", "64TiB"], "--cpu-bytes"),
        ({"KVTIER_NUM_CPU_BLOCKS": str(2**32)}, [], "KVTIER_NUM_CPU_BLOCKS"),
    ],
)
def test_the_memory_budget_names_where_the_cpu_size_came_from(env: dict[str, str], flag: list[str], where: str) -> None:
    """Regression (review, 2026-12-03): a size from the environment was blamed on --cpu-bytes, no flag given."""
    line = one_line_error(run("bench", "--no-progress", *flag, env=env))
    assert re.search(rf"CPU tier [\d.]+ TiB \({where}\)", line), line
    assert line.endswith(f"lower {where} or --device-blocks"), line


def test_replay_hints_help_points_at_a_section_that_exists() -> None:
    """Regression (review, 2026-12-03): the help named "README 'Per-request keys'", a section the README lost."""
    out = run("replay", "--help", env={"COLUMNS": "400"})
    assert "docs/vllm.md 'Per-request keys'" in out.stdout and "README 'Per" not in out.stdout, out.stdout
    assert "## Per-request keys" in (REPO / "docs" / "vllm.md").read_text()


def test_inspect_says_whether_the_directory_is_missing_or_not_a_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Regression (review, 2026-12-05): a path that does not exist was reported as "is not a
    directory"."""
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"")
    line = refused_here(capsys, "inspect", str(tmp_path / "missing"))
    assert f"fs tier root {tmp_path / 'missing'} does not exist" in line
    line = refused_here(capsys, "inspect", str(a_file))
    assert f"fs tier root {a_file} is not a directory" in line
    assert not (tmp_path / "missing").exists()


@pytest.mark.usefixtures("no_kvtier_env")
@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        (["config", "show", "--tiers", ""], "kvtier config show"),
        (["bench", "--fs-root", " "], "kvtier bench"),
        (["inspect", ""], "kvtier inspect"),
    ],
)
def test_an_empty_flag_value_is_a_usage_error_that_points_at_the_help(
    capsys: pytest.CaptureFixture[str], argv: list[str], prog: str
) -> None:
    """Regression (docs audit, 2026-12-05): the README says a usage error is one line that points at
    the subcommand's --help; an empty flag value was refused without it (and as ``kvtier config``
    for ``kvtier config show``)."""
    line = refused_here(capsys, *argv)
    assert line.startswith(f"{prog}: error: ") and line.endswith(f"(see '{prog} --help')"), line


@pytest.mark.parametrize(
    ("argv", "prog", "flag"),
    [
        (["bench", "--cpu-byte", "1GiB"], "kvtier bench", "--cpu-byte"),
        (["bench", "--shutdown", "5"], "kvtier bench", "--shutdown"),
        (["replay", "--synthetic", "chat", "--capac", "1%"], "kvtier replay", "--capac"),
        (["config", "show", "--tier", "cpu"], "kvtier config show", "--tier"),
    ],
)
def test_an_abbreviated_flag_is_an_unknown_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], prog: str, flag: str
) -> None:
    """Regression (docs audit, 2026-12-05): config.md says unknown flags are refused, but argparse
    took a prefix of a flag for the flag (``--cpu-byte 1GiB`` ran as ``--cpu-bytes``), so a script
    relying on one would change meaning when another flag sharing the prefix is added."""
    line = refused_here(capsys, *argv)
    assert line.startswith(f"{prog}: error: unrecognized arguments: {flag}"), line
    assert line.endswith(f"(see '{prog} --help')"), line
