"""Defects an outside audit of the ``kvtier`` command line found, each pinned by a regression test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.user_files import check_output

_SCRIPT = Path(sys.executable).parent / "kvtier"
KVTIER = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "kvtier.cli"]
LINE = '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0, 1, 2]}\n'


@pytest.mark.parametrize("name", ["new.json/", "trace.jsonl/", "dangling/"])
def test_an_output_path_ending_in_a_slash_is_refused_before_the_work(tmp_path: Path, name: str) -> None:
    """``x.json/`` names a directory, never a file: ``check_output`` refuses it up front (it used to
    pass, realpath dropping the slash, and the write failed only after the whole run)."""
    (tmp_path / "trace.jsonl").write_text(LINE)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="ends with a slash"):
        check_output(f"{tmp_path}/{name}", "--json")  # Path() would drop the slash
    proc = subprocess.run(
        [*KVTIER, "replay", "trace.jsonl", "--capacity", "2", "--no-belady", "--no-progress", "--json", name],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"--json '{name}'" in proc.stderr and "ends with a slash" in proc.stderr
    assert "replaying" not in proc.stderr  # refused before any request was replayed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "trace.jsonl"]


@pytest.mark.parametrize("text", ["1: lru\n", "null: 3\n", "policy: lru\n2024-01-01: x\n", "kvtier: {1: 2}\n"])
def test_a_config_file_key_that_is_not_text_is_refused_naming_it(tmp_path: Path, text: str) -> None:
    """A YAML key that is a number, null or date is not a setting's name: a clear error naming the file
    (it used to reach difflib and end as "TypeError: 'int' object is not iterable ... please report it")."""
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=r"bad\.yaml.*is not a setting's name"):
        load_config(config, env={})
    proc = subprocess.run(
        [*KVTIER, "config", "show", "--config", "bad.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "kvtier config: error: config file 'bad.yaml'" in proc.stderr
    assert "is not a setting's name" in proc.stderr
    assert "TypeError" not in proc.stderr and "please report it" not in proc.stderr


def _run_with_closed(fd: int, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``kvtier ARGS`` started with descriptor ``fd`` (1 or 2) closed, as ``>&-`` / ``2>&-`` do; the
    other one captured."""
    return subprocess.run(
        ["sh", "-c", f'exec "$@" {fd}>&-', "sh", *KVTIER, *args],
        cwd=cwd, capture_output=True, text=True, timeout=120, check=False,
    )


@pytest.mark.parametrize(
    "args",
    [["config", "show"], ["config", "reference"], ["config", "schema"],
     ["replay", "trace.jsonl", "--capacity", "2", "--no-belady", "--no-progress", "--json", "-"]],
)
def test_a_closed_standard_output_is_an_error_not_a_silent_success(tmp_path: Path, args: list[str]) -> None:
    """With descriptor 1 closed Python sets ``sys.stdout`` to None and ``print`` drops everything:
    ``config show >&-`` used to exit 0 having printed nothing, ``config reference >&-`` to fail with
    "AttributeError ... please report it". Now: exit 2 and one line saying standard output is closed."""
    (tmp_path / "trace.jsonl").write_text(LINE)
    proc = _run_with_closed(1, args, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert f"kvtier {args[0]}: error: standard output is closed" in proc.stderr
    assert "AttributeError" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_closed_standard_error_does_not_fail_a_good_run(tmp_path: Path) -> None:
    """Diagnostics have nowhere to go, but a replay that worked still exits 0 with its results (it
    used to exit 2 on an AttributeError); a bad trace still exits 2."""
    (tmp_path / "trace.jsonl").write_text(LINE)
    (tmp_path / "bad.jsonl").write_bytes(b'{"timestamp": \xff}\n')
    good = _run_with_closed(2, ["replay", "trace.jsonl", "--capacity", "2", "--no-belady", "--json", "-"], tmp_path)
    assert good.returncode == 0
    assert '"requests": 1' in good.stdout
    bad = _run_with_closed(2, ["replay", "bad.jsonl", "--capacity", "2", "--no-belady"], tmp_path)
    assert bad.returncode == 2


@pytest.mark.parametrize("field", ["geometry", "backpressure"])
def test_a_bad_key_of_a_merged_field_is_blamed_on_the_source_that_gave_it(tmp_path: Path, field: str) -> None:
    """``geometry``/``backpressure`` merge key by key across file, environment and flags; a bad key
    from the file used to be reported as coming from whichever source touched the field last."""
    bad, good = {
        "geometry": ("num_layers: 0", '{"dtype": "float16"}'),
        "backpressure": ("high_seconds: -1", '{"enabled": true}'),
    }[field]
    config = tmp_path / "kv.yaml"
    config.write_text(f"{field}: {{{bad}}}\n")
    env_var = f"KVTIER_{field.upper()}"
    with pytest.raises(ConfigError) as err:
        load_config(config, env={env_var: good})
    assert f"'{field}.{bad.split(':')[0]}' (from file {config})" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(config, env={}, cli={field: good})
    assert f"(from file {config})" in str(err.value) and f"--{field}" not in str(err.value)
    # the source of the value as a whole is still the last one that touched it
    assert load_config(env={env_var: good}).sources[field] == f"environment variable {env_var}"


def test_a_file_name_that_is_not_utf8_is_shown_not_a_crash_on_a_strict_utf8_stdout(tmp_path: Path) -> None:
    """Under a UTF-8 locale (en_US.UTF-8; here forced by PYTHONIOENCODING) Python's stdout encodes
    strictly, and a file name with byte 0xff (decoded as a lone surrogate) used to fail ``config
    show``/``replay`` of a good file with "UnicodeEncodeError ... please report it"."""
    raw = os.fsencode(tmp_path) + b"/"
    config, trace = os.fsdecode(raw + b"c\xff.yaml"), os.fsdecode(raw + b"t\xff.jsonl")
    Path(config).write_text("policy: lru\n")
    Path(trace).write_text(LINE)
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    for args in (["config", "show", "--config", config],
                 ["replay", trace, "--capacity", "2", "--no-belady", "--no-progress"]):
        proc = subprocess.run([*KVTIER, *args], capture_output=True, text=True, errors="replace", env=env,
                              timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        assert "\\udcff" in proc.stdout
        assert "UnicodeEncodeError" not in proc.stderr
