"""Regressions from the bench audit: per-tier labels, hidden secrets, early refusals."""

from __future__ import annotations

import json
import logging
import socket
import warnings
from pathlib import Path

import pytest
from test_bench import small_options

from kvtier.errors import ConfigError
from kvtier.workload import bench as bench_module
from kvtier.workload.bench import run_bench


def test_two_tiers_of_one_type_keep_their_own_rows(tmp_path: Path, private_shm: Path) -> None:
    """Regression: both fs tiers were labelled ``fs``; the second's bytes overwrote the first's."""
    first = {"type": "fs", "root": str(tmp_path / "fsA"), "max_bytes": 4 * 2**20}
    result = run_bench(small_options(private_shm, fs_root=str(tmp_path / "fsB"), extra_tiers=[first],
                                     tier_order=(0, "fs")))  # fmt: skip
    data = json.loads(json.dumps(result.to_dict()))
    assert result.errors == 0
    assert result.tiers == ["cpu", "1:fs", "2:fs"]
    assert set(data["tier_health"]) == {"1:fs", "2:fs"}
    assert {"device", "cpu", "1:fs", "2:fs"} <= set(data["hits"])
    assert data["bytes"]["cpu_to_1:fs"] > 0 and data["bytes"]["cpu_to_2:fs"] > 0
    assert [t["root"] for t in data["options"]["tiers"]] == [str(tmp_path / "fsA"), str(tmp_path / "fsB")]


def test_a_single_tier_of_a_type_keeps_its_plain_name(tmp_path: Path, private_shm: Path) -> None:
    result = run_bench(small_options(private_shm, fs_root=str(tmp_path / "fs")))
    assert result.tiers == ["cpu", "fs"] and "cpu_to_fs" in result.bytes and set(result.tier_health) == {"fs"}


def test_the_json_never_shows_a_redis_password(private_shm: Path) -> None:
    """Regression: ``options.tiers`` copied the raw config, URL password included."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"redis://admin:hunter2@127.0.0.1:{sock.getsockname()[1]}/0"  # closed: unreachable
    result = run_bench(small_options(private_shm, fs=False, redis_url=url), notify=lambda line: None)
    document = json.dumps(result.to_dict())
    assert "hunter2" not in document
    assert result.to_dict()["options"]["tiers"][0]["url"].startswith("redis://admin:***@127.0.0.1:")


def test_a_prompt_too_long_is_refused_before_hashing_or_temp_dirs(
    tmp_path: Path, private_shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the refusal came only after every prompt's block keys were hashed (minutes)."""

    def no_hashing(*args: object, **kwargs: object) -> None:
        raise AssertionError("hashed the workload before refusing it")

    monkeypatch.setattr(bench_module, "prefix_keys", no_hashing)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(ConfigError, match=r"raise --device-blocks to at least \d+"):
        run_bench(small_options(private_shm, device_blocks=4, temp_dir=str(scratch)))
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize("name", ["out.pgf", "out.ps", "out.eps"])
def test_plot_refuses_types_that_need_tools_or_warn(tmp_path: Path, name: str) -> None:
    """Regression: ``.pgf`` passed the early check, then failed after the run (no xelatex);
    ``.ps``/``.eps`` printed a stray PostScript transparency warning."""
    pytest.importorskip("matplotlib")
    from kvtier.cli import check_plot_file

    with pytest.raises(ConfigError) as info:
        check_plot_file(str(tmp_path / name))
    text = str(info.value)
    assert "\n" not in text and "--plot" in text
    assert all(f"'{kind}'" in text for kind in ("png", "svg", "pdf"))


@pytest.mark.parametrize("name", ["out.txt", "noext"])
def test_plot_refuses_an_unknown_type_without_rendering_any(tmp_path: Path, name: str) -> None:
    """Regression (2026-12-05, CI): the refusal of ``--plot out.txt`` test-rendered every type matplotlib
    knows (16 plots) to list the usable ones: 8 s on an idle 2-core host, over 30 s in a loaded CI
    run. It now names png, svg and pdf (always quiet) and matplotlib's types, rendering nothing."""
    pytest.importorskip("matplotlib")
    from kvtier.cli import check_plot_file
    from kvtier.workload.report import plot_format_problem

    plot_format_problem.cache_clear()
    with pytest.raises(ConfigError) as info:
        check_plot_file(str(tmp_path / name))
    text = str(info.value)
    assert "\n" not in text and "--plot" in text and "cannot write" in text
    assert all(f"'{kind}'" in text for kind in ("png", "svg", "pdf"))
    assert plot_format_problem.cache_info().currsize == 0, "a plot was rendered to refuse the type"


@pytest.mark.parametrize("kind", ["png", "svg", "pdf"])
def test_plot_accepts_types_that_render_quietly(tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    from kvtier.cli import check_plot_file
    from kvtier.workload.report import plot_format_problem

    check_plot_file(str(tmp_path / f"out.{kind}"))
    plot_format_problem.cache_clear()
    with caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_format_problem(kind) is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
