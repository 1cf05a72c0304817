"""``kvtier replay`` and ``bench`` as a person sizing tiers uses them: progress on a terminal only,
``--plot``, ``--json -``, sizes as capacities, the chaining warning, and CLI manners (``-v`` after
the subcommand, one-line usage errors, no trailing spaces when piped, tiers in the order given)."""

from __future__ import annotations

import json
import os
import pty
import select
import struct
import subprocess
import time
from pathlib import Path

import pytest

from test_cli import KVTIER, REPO, TINY_BENCH, run

SMALL = ["replay", "--synthetic", "chat", "--requests", "300", "--capacity", "20,60"]


def _one_error_line(out: subprocess.CompletedProcess[str], *words: str) -> None:
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    for word in words:
        assert word in lines[0], lines[0]


def _chain_trace(path: Path, requests: list[list[int]]) -> Path:
    path.write_text("".join(
        json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 4, "hash_ids": ids}) + "\n"
        for i, ids in enumerate(requests)
    ))  # fmt: skip
    return path


# --------------------------------------------------------------------------- progress


def _run_on_a_terminal(args: list[str], timeout: float = 240) -> tuple[int, str]:
    """Run ``kvtier ARGS`` with stdout and stderr on a pseudo-terminal; its exit status and all it drew."""
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update({"COLUMNS": "150", "TERM": "xterm"})
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([*KVTIER, *args], stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
                            cwd=REPO, env=env)  # fmt: skip
    os.close(follower)
    drawn = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                drawn += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=30), drawn.decode("utf-8", "replace")
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()


def test_replay_shows_progress_on_a_terminal(private_shm: Path) -> None:
    code, drawn = _run_on_a_terminal([*SMALL, "--requests", "3000", "--shm-dir", str(private_shm)])
    assert code == 0, drawn
    assert "req/s" in drawn and "ETA" in drawn, drawn[-2000:]
    assert "/12000" in drawn  # requests done of all runs: 3000 x 2 capacities x (return-time, lru)
    assert "\x1b[" in drawn  # drawn and erased with terminal controls
    assert "prefix-hit rate vs CPU capacity" in drawn


def test_replay_progress_can_be_turned_off_on_a_terminal(private_shm: Path) -> None:
    code, drawn = _run_on_a_terminal([*SMALL, "--no-progress", "--shm-dir", str(private_shm)])
    assert code == 0, drawn
    assert "req/s" not in drawn and "ETA" not in drawn


def test_replay_piped_prints_no_progress_and_no_trailing_spaces(private_shm: Path) -> None:
    out = run(*SMALL, "--requests", "2000", "--shm-dir", str(private_shm))
    assert out.returncode == 0, out.stderr
    for stream in (out.stdout, out.stderr):
        assert "req/s" not in stream and "ETA" not in stream and "\x1b" not in stream
        assert not [line for line in stream.splitlines() if line != line.rstrip()], stream
    assert "replaying 2000 requests with 20 CPU blocks (return-time)..." in out.stderr
    assert "Belady (optimal)" in out.stdout and "CPU tier alone" in out.stdout and "any capacity" in out.stdout


def test_bench_tables_piped_have_no_trailing_spaces(private_shm: Path) -> None:
    out = run(*TINY_BENCH, "--shm-dir", str(private_shm))
    assert out.returncode == 0, out.stderr
    assert "hit rate by tier" in out.stdout
    assert not [line for line in out.stdout.splitlines() if line != line.rstrip()]


# --------------------------------------------------------------------------- --json - and --plot


def test_replay_json_to_stdout_parses_and_tables_go_to_stderr(private_shm: Path) -> None:
    out = run(*SMALL, "--policy", "lru,arc", "--json", "-", "--shm-dir", str(private_shm))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [row["capacity"] for row in data["rows"]] == [20, 60]
    assert set(data["rows"][0]["policies"]) == {"lru", "arc"}
    assert data["chaining"]["chained"] is True and data["block_bytes"] is None
    assert "prefix-hit rate vs CPU capacity" in out.stderr


def test_bench_json_to_stdout_parses(private_shm: Path) -> None:
    out = run(*TINY_BENCH, "--shm-dir", str(private_shm), "--json", "-")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["requests"] > 0
    assert "hit rate by tier" in out.stderr


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def test_replay_plot_draws_a_png(tmp_path: Path, private_shm: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "out.png"
    out = run(*SMALL, "--policy", "lru,arc,return-time", "--model", "tiny", "--plot", str(png),
              "--shm-dir", str(private_shm))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"wrote {png}" in out.stderr
    assert _png_size(png) == (1200, 500)


def test_replay_plot_with_an_fs_tier_and_to_stdout(tmp_path: Path, private_shm: Path) -> None:
    pytest.importorskip("matplotlib")
    out = subprocess.run(
        [*KVTIER, *SMALL, "--requests", "80", "--fs-root", str(tmp_path / "fs"), "--plot", "-",
         "--shm-dir", str(private_shm)],
        capture_output=True, cwd=REPO, timeout=240, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"prefix-hit rate vs CPU capacity" in out.stderr  # the tables moved to stderr


def test_replay_makes_a_missing_fs_root_private(tmp_path: Path, private_shm: Path) -> None:
    """Regression (review, 2026-12-03): a missing --fs-root (and its parents) was made 0755."""
    old = os.umask(0o022)
    try:
        out = run(*SMALL, "--requests", "40", "--fs-root", str(tmp_path / "a" / "fs"), "--shm-dir", str(private_shm),
                  "--no-progress")  # fmt: skip
    finally:
        os.umask(old)
    assert out.returncode == 0, out.stderr
    assert [oct((tmp_path / p).stat().st_mode & 0o7777) for p in ("a", "a/fs")] == [oct(0o700)] * 2


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    blocker = tmp_path / "no-matplotlib" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is not installed here')\n")
    env = {"PYTHONPATH": str(blocker.parent)}
    out = run(*SMALL, "--plot", str(tmp_path / "p.png"), env=env)
    _one_error_line(out, "--plot needs matplotlib", "pip install 'kvtier[plot]'")
    assert not (tmp_path / "p.png").exists()


# --------------------------------------------------------------------------- sizes


def test_capacity_sizes_convert_with_the_model(private_shm: Path) -> None:
    # tiny: 2 layers x 2 heads x 64 dim x 2 (k, v) x 2 bytes = 1 KiB a token; 512 tokens = 512 KiB a block
    out = run(*SMALL, "--capacity", "2560KiB,4MiB,30", "--model", "tiny", "--json", "-", "--shm-dir", str(private_shm))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["block_bytes"] == 512 * 1024 and data["model"] == "tiny"
    assert [(r["capacity"], r["capacity_bytes"]) for r in data["rows"]] == [
        (5, 5 * 524288), (8, 8 * 524288), (30, 30 * 524288)
    ]  # fmt: skip
    assert "block size: 512.0 KiB of KV per trace block (tiny, 512 tokens a block)" in out.stderr
    out = run(*SMALL, "--capacity", "1MiB", "--block-bytes", "256KiB", "--json", "-", "--shm-dir", str(private_shm))
    assert out.returncode == 0, out.stderr
    assert [r["capacity"] for r in json.loads(out.stdout)["rows"]] == [4]
    out = run(*SMALL, "--capacity", "1MiB", "--model", "tiny", "--block-tokens", "16", "--json", "-",
              "--shm-dir", str(private_shm))  # fmt: skip
    assert [r["capacity"] for r in json.loads(out.stdout)["rows"]] == [64]  # 16 KiB blocks


def test_the_model_may_come_from_the_environment(private_shm: Path) -> None:
    out = run(*SMALL, "--capacity", "4MiB", "--json", "-", "--shm-dir", str(private_shm),
              env={"KVTIER_MODEL": "tiny"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert [r["capacity"] for r in json.loads(out.stdout)["rows"]] == [8]
    assert "(tiny, from environment variable KVTIER_MODEL, 512 tokens a block)" in out.stderr


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--capacity", "4GiB"], ["--capacity '4GiB' is a size", "--model"]),
        (["--capacity", "4GiB", "--model", "gpt-9"], ["--model", "'gpt-9' is not a model preset", "--block-bytes"]),
        (["--capacity", "64KiB", "--model", "tiny"], ["--capacity '64KiB' holds less than one block of 512.0 KiB"]),
        (["--capacity", "1PiB", "--model", "tiny"], ["--capacity '1PiB' is", "at most"]),
        (["--capacity", "4 blocks"], ["--capacity '4 blocks'", "not understood"]),
        (["--capacity", "-1"], ["--capacity '-1'", "not a block count"]),
        (["--block-bytes", "0"], ["--block-bytes", "must be positive"]),
        (["--block-bytes", "1MiB", "--model", "tiny"], ["--block-bytes", "drop --model"]),
        (["--block-tokens", "16"], ["--block-tokens", "--model", "--store-chunk mixed"]),
        (["--block-tokens", "0", "--model", "tiny"], ["--block-tokens", "at least 1"]),
        (["--plot", "out.xyz"], ["--plot", "'xyz'", "suffix"]),
        (["--plot", "-", "--json", "-"], ["both write to standard output"]),
        (["--no-such-flag"], ["unrecognized arguments: --no-such-flag", "see 'kvtier replay --help'"]),
    ],
)
def test_bad_replay_flags_are_one_clear_line(flags: list[str], words: list[str], tmp_path: Path) -> None:
    out = run(*SMALL, *flags)
    _one_error_line(out, *words)


def test_block_tokens_sets_the_mixed_decode_stores_without_a_model(tmp_path: Path, private_shm: Path) -> None:
    """Regression (review, 2026-12-05): its help says --block-tokens sets the decode stores of
    --store-chunk mixed, yet without --model (or beside --block-bytes) it was refused."""
    counts = []
    for tokens in ("512", "16"):
        out = run(*SMALL, "--store-chunk", "mixed", "--block-tokens", tokens, "--policy", "lru", "--json", "-",
                  "--shm-dir", str(private_shm))  # fmt: skip
        assert out.returncode == 0, out.stderr
        counts.append([row["kvtier"]["evictions"] for row in json.loads(out.stdout)["rows"]])
    # Decoded blocks are stored one at a time: 16-token blocks make more of them, so more evictions.
    assert all(few < many for few, many in zip(counts[0], counts[1], strict=True)), counts
    out = run(*SMALL, "--store-chunk", "mixed", "--block-tokens", "16", "--block-bytes", "1MiB", "--policy", "lru",
              "--shm-dir", str(private_shm))  # fmt: skip
    assert out.returncode == 0, out.stderr


# --------------------------------------------------------------------------- chaining


def test_a_trace_that_is_not_prefix_chained_is_warned_about(tmp_path: Path, private_shm: Path) -> None:
    trace = _chain_trace(tmp_path / "t.jsonl", [[1, 2, 3], [4, 2, 3], [5, 6], [1, 2, 3]])
    out = run("replay", str(trace), "--capacity", "4", "--json", "-", "--shm-dir", str(private_shm))
    assert out.returncode == 0, out.stderr
    assert (
        "kvtier replay: warning: trace " + str(trace) + ": hash_ids are not prefix-chained: 1 of 6 distinct "
        "hash_ids appear under more than one parent (3 of 11 block references)"
    ) in out.stderr
    chaining = json.loads(out.stdout)["chaining"]
    assert chaining == {"multi_parent_ids": 1, "multi_parent_refs": 3, "repeating_requests": 0,
                        "distinct_ids": 6, "block_refs": 11, "chained": False}  # fmt: skip
    trace = _chain_trace(tmp_path / "ok.jsonl", [[1, 2, 3], [1, 2, 4], [5]])
    out = run("replay", str(trace), "--capacity", "4", "--shm-dir", str(private_shm))
    assert out.returncode == 0 and "warning" not in out.stderr, out.stderr


# --------------------------------------------------------------------------- manners


def test_verbose_is_accepted_after_the_subcommand(private_shm: Path) -> None:
    for flags in (["-v"], ["--verbose"], ["-vv"]):
        out = run(*SMALL, "--requests", "20", *flags, "--shm-dir", str(private_shm))
        assert out.returncode == 0, out.stderr
    out = run("replay", "-vv", "--synthetic", "chat", "--requests", "20", "--capacity", "5",
              "--shm-dir", str(private_shm))  # fmt: skip
    assert "DEBUG" in out.stderr
    assert run("config", "show", "-v").returncode == 0
    assert run("-v", "config", "-v", "schema", "-v").returncode == 0


@pytest.mark.parametrize(
    "args",
    [[], ["frobnicate"], ["replay", "--capacity"], ["bench", "--sessions", "x"], ["config"],
     ["config", "show", "--bogus"], ["sweep-shm", "extra"]],
)  # fmt: skip
def test_usage_errors_are_one_line_pointing_at_help(args: list[str]) -> None:
    out = run(*args)
    _one_error_line(out, "error:", "--help')")
    assert "usage:" not in out.stderr


def _bench_tier_names(private_shm: Path, *flags: str) -> list[str]:
    out = run(*TINY_BENCH, "--shm-dir", str(private_shm), "--json", "-", *flags)
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout)["hits"])


def test_bench_tiers_come_in_the_order_given(tmp_path: Path, private_shm: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("tiers:\n  - type: memory\n    max_bytes: 16MiB\n")
    fs = str(tmp_path / "fs")
    assert _bench_tier_names(private_shm, "--config", str(config), "--fs-root", fs)[2:] == ["memory", "fs"]
    assert _bench_tier_names(private_shm, "--fs-root", fs, "--config", str(config))[2:] == ["fs", "memory"]
    assert _bench_tier_names(private_shm, "--memory-tier", "8MiB", "--fs-root", fs)[2:] == ["memory", "fs"]


@pytest.mark.parametrize(
    ("value", "words"),
    [("0", ["--fs-blocks", "'0'"]), ("4GiB", ["--fs-blocks", "is a size"]), ("10%,20%", ["--fs-blocks", "one"]),
     ("abc", ["--fs-blocks", "'abc'"]), ("0.00001%", ["--fs-blocks", "less than one block"])],
)  # fmt: skip
def test_fs_blocks_is_refused_naming_itself_before_any_replay(tmp_path: Path, value: str, words: list[str]) -> None:
    """Regression: --fs-blocks used --capacity's parser (its errors said '--capacity') and was checked
    after the fs directory was made and announced."""
    out = run(*SMALL, "--fs-root", str(tmp_path), "--fs-blocks", value)
    assert out.returncode == 2
    _one_error_line(out, *words)
    assert "--capacity" not in out.stderr and "fs tiers in" not in out.stderr
    # Regression (review, 2026-12-05): "0" suggested "sizes like 4GiB", which --fs-blocks refuses
    assert "GiB" not in out.stderr or value == "4GiB"
    assert list(tmp_path.iterdir()) == []


def test_two_outputs_naming_one_file_are_refused(tmp_path: Path) -> None:
    """Regression: --json X --plot X wrote the JSON, then the PNG over it, and exited 0."""
    target = tmp_path / "a.png"
    out = run(*SMALL, "--json", str(target), "--plot", str(target))
    assert out.returncode == 2
    _one_error_line(out, "--json", "--plot", "same file")
    assert not target.exists()
    (tmp_path / "link.png").symlink_to(target)
    out = run(*SMALL, "--json", str(target), "--plot", str(tmp_path / "link.png"))
    assert out.returncode == 2 and "same file" in out.stderr


def test_a_bad_fs_root_is_refused_before_the_workload_is_read(tmp_path: Path) -> None:
    """Regression (review, 2026-12-02): --fs-root was checked only after the whole trace or
    workload was read (22 s for 200,000 requests)."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    started = time.monotonic()
    out = run("replay", "--synthetic", "chat", "--requests", "200000", "--fs-root", str(not_a_dir))
    assert out.returncode == 2 and "--fs-root" in out.stderr and "not a directory" in out.stderr
    assert time.monotonic() - started < 15.0, "the workload was generated before the check"
