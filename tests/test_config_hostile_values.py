"""Hostile configuration values: an alias bomb, a password, a BOM, a null, each refused or read clearly."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvtier.config import load_config, parse_size
from kvtier.errors import ConfigError
from kvtier.plugins import load_class
from kvtier.tiers.base import SecondaryTier
from kvtier.tiers.registry import validate_tier_options
from kvtier.validation import check_seconds, shown_value


def _bomb(levels: int = 7, width: int = 9) -> str:
    """A YAML flow list of ``width ** levels`` leaves through aliases, a few hundred bytes."""
    items, inner = [], "[" + ",".join(["x"] * width) + "]"
    for level in range(levels):
        anchor = f"a{level}"
        items.append(f"&{anchor} {inner}")
        inner = "[" + ",".join([f"*{anchor}"] * width) + "]"
    return "[" + ", ".join([*items, inner]) + "]"


def _refused_fast(path: Path) -> str:
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert time.monotonic() - start < 5, "the value was walked whole"
    return str(err.value)


@pytest.mark.parametrize(
    "text",
    [
        "cpu_bytes: {bomb}\n",
        "cpu_bytes: 1GiB\ntiers:\n  - {{type: memory, max_bytes: {bomb}}}\n",
        "cpu_bytes: 1GiB\ntiers:\n  - {bomb}\n",
    ],
    ids=["cpu_bytes", "max_bytes", "tiers[0]"],
)
def test_an_alias_bomb_is_refused_with_a_short_message(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(text.format(bomb=_bomb()))
    assert path.stat().st_size < 2000
    message = _refused_fast(path)
    assert len(message) < 400, message[:400]


def test_shown_value_is_bounded_for_any_value() -> None:
    deep: list[object] = []
    for _ in range(10_000):
        deep = [deep]
    wide = [list(range(10))] * 100
    for value in (deep, wide, "x" * 1_000_000, 10**200, {i: i for i in range(10_000)}):
        assert len(shown_value(value)) < 200
    assert "hunter2" not in shown_value(["redis://admin:hunter2@h/0"])
    assert "hunter2" not in shown_value({"url": "rediss://h/0?password=hunter2"})
    assert shown_value([1, 2]) == "[1, 2]"


def test_check_seconds_shows_a_large_value_shortened() -> None:
    big = [list(range(1000))] * 1000
    with pytest.raises(ConfigError) as err:
        check_seconds(big, "timeout")
    assert len(str(err.value)) < 400
    with pytest.raises(ConfigError) as err:
        check_seconds(["redis://admin:hunter2@h/0"], "timeout")
    assert "hunter2" not in str(err.value)


def test_parse_size_never_shows_a_list_or_a_url() -> None:
    with pytest.raises(ConfigError) as err:
        parse_size(["redis://admin:hunter2@h/0"])  # type: ignore[arg-type]
    assert "hunter2" not in str(err.value) and "list of 1 items" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_size("redis://admin:hunter2@h/0")
    assert "hunter2" not in str(err.value)


@pytest.mark.parametrize(
    "tiers", ['["redis://admin:hunter2@h/0"]', '[{"type": "redis://admin:hunter2@h/0"}]', '[{"type": "x@hunter2"}]']
)
def test_a_password_in_a_tier_spec_is_never_echoed(tiers: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(env={"KVTIER_TIERS": tiers})
    assert "hunter2" not in str(err.value)
    assert "not shown" in str(err.value)


def test_an_import_path_with_a_password_or_too_long_is_not_echoed() -> None:
    with pytest.raises(ConfigError) as err:
        load_class("redis://admin:hunter2@h/0", SecondaryTier, "tier")
    assert "hunter2" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_class("m:" + "C" * 1_000_000, SecondaryTier, "tier")
    assert len(str(err.value)) < 400
    with pytest.raises(ConfigError) as err:
        validate_tier_options({"type": "nfs://admin:hunter2@h"}, where="tiers[0]")
    assert "hunter2" not in str(err.value)


@pytest.mark.parametrize("name", ["c.json", "c.toml", "c.yaml"])
def test_a_config_file_may_start_with_a_utf8_bom(tmp_path: Path, name: str) -> None:
    text = {"c.json": '{"cpu_bytes": "1GiB"}', "c.toml": 'cpu_bytes = "1GiB"\n', "c.yaml": "cpu_bytes: 1GiB\n"}[name]
    path = tmp_path / name
    path.write_text(text, encoding="utf-8-sig")
    assert path.read_bytes().startswith(b"\xef\xbb\xbf")
    assert load_config(path, env={}).cpu_bytes == 2**30


def test_json_null_for_a_flag_or_variable_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("tiers:\n  - {type: memory}\n")
    with pytest.raises(ConfigError, match=r"KVTIER_TIERS is JSON null.*unset KVTIER_TIERS"):
        load_config(path, env={"KVTIER_TIERS": "null"})
    with pytest.raises(ConfigError, match=r"--tiers is JSON null.*leave --tiers out"):
        load_config(path, env={}, cli={"tiers": "null"})
    with pytest.raises(ConfigError, match=r"KVTIER_GEOMETRY is JSON null"):
        load_config(env={"KVTIER_GEOMETRY": " null "})
