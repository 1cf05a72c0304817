"""Classes named by import path (policies, tiers): whatever the module does while importing, one ConfigError.

Each module below fails its import in its own way; loading it as a policy or a
tier, from Python, a config file, the environment or the command line, gives a
ConfigError naming the import path, the module and the error, never a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.plugins import load_class
from kvtier.policies import EvictionPolicy, resolve_policy
from kvtier.tiers.registry import resolve_tier_class

BROKEN_MODULES = {
    "syntax": ("def broken(:\n", "SyntaxError"),
    "name": ("value = undefined_name\n", "NameError: name 'undefined_name' is not defined"),
    "runtime": ("raise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here"),
    "exit": ("import sys\nsys.exit(3)\n", "SystemExit: 3"),
    "zero": ("1 / 0\n", "ZeroDivisionError"),
    "missing_dep": ("import no_such_dependency_xyz\n", "No module named 'no_such_dependency_xyz'"),
    "attr": ("import os\nos.no_such_function()\n", "AttributeError"),
    "indent": ("def f():\nreturn 1\n", "IndentationError"),
    "recursion": ("def f(): return f()\nf()\n", "RecursionError"),
    "bad_getattr": ("def __getattr__(name):\n    raise KeyError(name)\n", "KeyError"),
    "multiline": ("raise ValueError('first line\\nsecond line\\n' * 50)\n", "ValueError: first line second line"),
    # (regression, 2026-12-06, review: a BaseException of the module's own escaped as a traceback)
    "base_exception": ("class Stop(BaseException):\n    pass\n\nraise Stop('boom')\n", "Stop: boom"),
}


@pytest.fixture
def broken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Import-path prefixes of freshly written broken modules (unique names: nothing cached between tests)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = {}
    for kind, (source, _) in BROKEN_MODULES.items():
        name = f"broken_{kind}_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(source)
        names[kind] = name
    return names


@pytest.mark.parametrize("kind", BROKEN_MODULES)
def test_any_import_failure_is_a_config_error_naming_module_and_error(broken: dict[str, str], kind: str) -> None:
    path = f"{broken[kind]}:Thing"
    expected = BROKEN_MODULES[kind][1]
    for load in (lambda: resolve_policy(path), lambda: resolve_tier_class(path),
                 lambda: load_class(path, EvictionPolicy, "eviction policy")):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            load()
        text = str(err.value)
        assert repr(path) in text and expected in text, text
        assert "\n" not in text and len(text) < 500, text
        assert err.value.__cause__ is None and err.value.__suppress_context__, "the import's traceback is kept"


@pytest.mark.parametrize("kind", ["syntax", "runtime", "exit"])
def test_config_names_the_field_and_the_module(broken: dict[str, str], kind: str, tmp_path: Path) -> None:
    path = f"{broken[kind]}:Thing"
    with pytest.raises(ConfigError, match=r"config field 'policy' \(from environment variable KVTIER_POLICY\)"):
        load_config(env={"KVTIER_POLICY": path})
    cfg = tmp_path / "kv.yaml"
    cfg.write_text(f"tiers:\n  - type: {path}\n")
    with pytest.raises(ConfigError, match=r"tiers\[0\].*" + BROKEN_MODULES[kind][1].split(":")[0]):
        load_config(cfg, env={})


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        (".relative:Thing", "is not an absolute module name"),
        ("a/b:Thing", "is not an absolute module name"),
        ("pkg..mod:Thing", "is not an absolute module name"),
        (":Thing", "must look like 'package.module:ClassName'"),
        ("os:", "must look like 'package.module:ClassName'"),
        ("os:path", "does not name an EvictionPolicy subclass"),
    ],
)
def test_malformed_paths_are_refused_before_any_import(path: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        resolve_policy(path)


def test_the_command_line_prints_one_line_and_exits_2(broken: dict[str, str], tmp_path: Path) -> None:
    for kind in ("syntax", "exit", "recursion"):
        for flag, value in (("--policy", f"{broken[kind]}:Thing"), ("--tiers", f'[{{"type": "{broken[kind]}:X"}}]')):
            out = subprocess.run([sys.executable, "-m", "kvtier.cli", "config", "show", flag, value],
                                 capture_output=True, text=True, timeout=60, check=False,
                                 env={"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path),
                                      os.environ.get("PYTHONPATH", "")) if p), "PATH": "/usr/bin:/bin"})  # fmt: skip
            assert out.returncode == 2, out.stderr
            lines = out.stderr.strip().splitlines()
            assert len(lines) == 1 and broken[kind] in lines[0] and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("where", ["module", "set_name"])
def test_an_interrupt_while_importing_stays_an_interrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         where: str) -> None:  # fmt: skip
    """Regression (2026-12-05): Ctrl-C or SIGTERM landing while a tier's module was being imported (the bench
    builds its tiers after the signal handlers are in place) inside a class body's ``__set_name__``
    reached the loader as ``RuntimeError: Error calling __set_name__`` (Python 3.11 wraps it), and
    the command said "fix the module" and exited 2 instead of ending as interrupted."""
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"interrupted_{where}_{uuid.uuid4().hex[:8]}"
    source = {
        "module": "raise KeyboardInterrupt\n",
        "set_name": "class Field:\n    def __set_name__(self, owner, name):\n        raise KeyboardInterrupt\n\n"
                    "class Work:\n    keys = Field()\n",
    }[where]  # fmt: skip
    (tmp_path / f"{name}.py").write_text(source)
    with pytest.raises(KeyboardInterrupt):
        load_class(f"{name}:Work", EvictionPolicy, "eviction policy")
