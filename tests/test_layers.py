"""The architecture as tests: the import layers, and the manager's rooms kept small.

The layer contracts live in pyproject.toml (``[tool.importlinter]``) and are
checked by import-linter, the same as running ``lint-imports`` in the repository
root: each room imports only rooms below it, no two modules of a package import
each other (directly or through others), and the manager's rooms never import
its core.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANAGER = ROOT / "src" / "kvtier" / "manager"


def test_import_contracts_hold() -> None:
    # In a child process: import-linter configures logging (disabling every logger that exists)
    # and changes sys.path, which would leak into the other tests of this run.
    config = str(ROOT / "pyproject.toml")
    lint = f"import importlinter.cli as c; raise SystemExit(c.lint_imports({config!r}, no_cache=True, no_logo=True))"
    done = subprocess.run([sys.executable, "-c", lint], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _class(path: Path, name: str) -> ast.ClassDef:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"no class {name} in {path}")


def test_the_manager_rooms_stay_small() -> None:
    """Issue 22's bounds: core.py at most 650 lines, every other room at most 300; the
    TieringManager class at most 35 methods and 20 attributes."""
    sizes = {path.name: len(path.read_text().splitlines()) for path in MANAGER.glob("*.py")}
    assert sizes.pop("core.py") <= 650
    assert all(lines <= 300 for lines in sizes.values()), sizes
    manager = _class(MANAGER / "core.py", "TieringManager")
    methods = [n.name for n in manager.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    assert len(methods) <= 35, methods
    attributes = {
        node.attr
        for node in ast.walk(manager)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name) and node.value.id == "self"
    }  # fmt: skip
    assert len(attributes) <= 20, sorted(attributes)


def test_the_core_neither_indexes_tiers_by_position_nor_catches_every_exception() -> None:
    """A tier's index is its handle's ``index``; tier calls are guarded in the tier set only."""
    core = (MANAGER / "core.py").read_text()
    assert not re.search(r"\bpos\s*\+\s*1\b", core)
    handlers = [node for node in ast.walk(ast.parse(core)) if isinstance(node, ast.ExceptHandler)]
    broad = [h.lineno for h in handlers if h.type is None or ast.unparse(h.type) in ("Exception", "BaseException")]
    assert not broad, f"core.py catches every exception at lines {broad}"
