"""``kvtier config schema``: the JSON Schema accepts what a configuration file may hold and refuses
what the loader refuses (review, 2026-12-05: the reference's own example was rejected, sizes typed
as integers only, and bounds came out under pydantic's names, which validators ignore, so
``wait_timeout: 0`` passed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvtier.config import load_config
from kvtier.config.json_schema import config_json_schema
from kvtier.errors import ConfigError
from kvtier.user_files import load_yaml

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def _validator() -> Any:
    schema = config_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _reference_example() -> dict[str, Any]:
    text = REFERENCE.read_text()
    block = text[text.rindex("```yaml") + len("```yaml") :]
    data = load_yaml(block[: block.index("```")])
    assert isinstance(data, dict)
    return data


def test_the_references_example_is_valid_and_loads() -> None:
    example = _reference_example()
    assert list(_validator().iter_errors(example)) == []
    load_config(env={}, cli=example)  # and the loader takes it too


@pytest.mark.parametrize(
    "good",
    [{"cpu_bytes": 4294967296}, {"cpu_bytes": "512MiB"}, {"cpu_bytes": "1.5 GiB"}, {"cpu_bytes": "4G"},
     {"shutdown_timeout": None}, {"shutdown_timeout": "none"}, {"shutdown_timeout": 30}, {"wait_timeout": 2.5}],
)  # fmt: skip
def test_what_the_loader_takes_the_schema_takes(good: dict[str, Any]) -> None:
    load_config(env={}, cli=good)
    assert list(_validator().iter_errors(good)) == []


@pytest.mark.parametrize(
    "bad",
    [{"wait_timeout": 0}, {"shutdown_timeout": 0}, {"wait_timeout": 5000}, {"cpu_bytes": "4 apples"},
     {"cpu_bytes": True}, {"num_cpu_blocks": 0}, {"policy": 5},
     # regression (2026-12-06, review): the schema's cpu_bytes was a plain integer
     {"cpu_bytes": -5}, {"cpu_bytes": 0}, {"cpu_bytes": 2**63}],
)  # fmt: skip
def test_what_the_loader_refuses_the_schema_refuses(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        load_config(env={}, cli=bad)
    assert list(_validator().iter_errors(bad)), bad


def test_the_command_prints_it() -> None:
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "config", "schema"], capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert json.loads(out.stdout) == config_json_schema()
    assert '"ge"' not in out.stdout and '"le"' not in out.stdout


@pytest.mark.parametrize("data", [{"kvtier": {"cpu_bytes": "4GiB"}}, {"kvtier": {}}])
def test_the_documented_kvtier_section_is_valid(data: dict[str, Any], tmp_path: Path) -> None:
    # Regression (2026-12-06, review): the schema refused the kvtier: section the loader takes.
    path = tmp_path / "kvtier.json"
    path.write_text(json.dumps(data))
    load_config(path, env={})
    assert list(_validator().iter_errors(data)) == []


@pytest.mark.parametrize("data", [{"kvtier": {"cpu_bytes": "4 apples"}}, {"kvtier": {}, "cpu_bytes": "4GiB"},
                                  {"kvtier": 5}, {"kvtier": {"kvtier": {}}}])  # fmt: skip
def test_a_bad_kvtier_section_is_refused_by_both(data: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "kvtier.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError):
        load_config(path, env={})
    assert list(_validator().iter_errors(data)), data
