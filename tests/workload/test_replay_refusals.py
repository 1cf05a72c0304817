"""``kvtier replay`` with a stranger's input (review of 2026-12-06): a file name holding markup or
mathtext, a baseline that hits nothing, percentages spelled as float() reads them, a --limit that
does not shrink what is generated. Each was a crash after the work, a wrong figure or a check
passed by."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.workload.capacity import parse_capacities
from test_cli import run

# LRU of 2 blocks, 1-block stores: no prefix hit at all; return-time holds [100] for the last request.
_ZERO_FOR_LRU = [[100, 101], [300, 301, 302], [0, 1, 2], [0, 1], [200, 201, 202], [100]]


def _trace(path: Path) -> Path:
    path.write_text("".join(
        json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}) + "\n"
        for i, ids in enumerate(_ZERO_FOR_LRU)
    ))  # fmt: skip
    return path


@pytest.mark.parametrize("name", ["x[/b].jsonl", "[bold red]y.jsonl"])
def test_a_trace_name_with_markup_is_printed_as_it_is(tmp_path: Path, name: str) -> None:
    # Regression: rich read the name as markup: '[/b]' crashed the replay after every run
    # (MarkupError), '[bold red]' vanished from the header.
    (tmp_path / "x[").mkdir()  # "x[/b].jsonl" is the file "b].jsonl" in the directory "x["
    trace = _trace(tmp_path / name)
    out = run("replay", str(trace), "--capacity", "2", "--policy", "lru")
    assert out.returncode == 0, out.stderr
    assert f"{trace}: 6 requests" in out.stdout


def test_a_trace_name_with_dollars_plots(tmp_path: Path) -> None:
    # Regression: matplotlib read "$\foo$" in the title (the file name) as mathtext and failed.
    pytest.importorskip("matplotlib")
    trace = _trace(tmp_path / "m$\\foo$.jsonl")
    plot = tmp_path / "curve.png"
    out = run("replay", str(trace), "--capacity", "2", "--policy", "lru", "--plot", str(plot))
    assert out.returncode == 0, out.stderr
    assert plot.stat().st_size > 0


def test_a_ratio_over_an_lru_that_hit_nothing_is_not_one(tmp_path: Path) -> None:
    # Regression: return-time's 7.1 % against LRU's 0 % was shown as 1.000x LRU.
    trace = _trace(tmp_path / "zero.jsonl")
    rows = tmp_path / "rows.json"
    out = run("replay", str(trace), "--capacity", "2", "--store-chunk", "1", "--policy", "lru,return-time",
              "--json", str(rows))  # fmt: skip
    assert out.returncode == 0, out.stderr
    policies = json.loads(rows.read_text())["rows"][0]["policies"]
    assert policies["lru"]["hit_rate"] == 0 and policies["lru"]["ratio_to_lru"] == 1.0
    assert policies["return-time"]["hit_rate"] > 0 and policies["return-time"]["ratio_to_lru"] is None
    assert "(-x lru" in out.stdout and "1.000x lru" in out.stdout


@pytest.mark.parametrize("share", ["1_0%", "1e2%", "nan%", "\u0665%", "5 %"])
def test_a_share_is_a_plain_decimal(share: str) -> None:
    # Regression: float() read "1_0" and "1e2" while a block count refuses "1_000" and "1e3".
    with pytest.raises(ConfigError, match="not a percentage"):
        parse_capacities(share, 10**6)


@pytest.mark.parametrize("share, value", [("5%", 0.05), ("0.5%", 0.005), (".5%", 0.005), ("100%", 1.0)])
def test_plain_shares_still_parse(share: str, value: float) -> None:
    assert parse_capacities(share, 10**6)[0].share == pytest.approx(value)


def test_limit_does_not_pass_the_memory_check_of_what_is_generated() -> None:
    # Regression: --limit 1 let 10,000,000 generated requests (~38 GiB) past the check; the whole
    # workload is generated before the limit keeps its first requests.
    out = run("replay", "--synthetic", "chat", "--requests", "10000000", "--limit", "1", "--capacity", "3",
              timeout=60)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "--requests" in out.stderr and "Traceback" not in out.stderr
