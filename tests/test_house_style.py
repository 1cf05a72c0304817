"""House rules that a reviewer would otherwise check by hand."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvtier"
MAX_LINES = 80


def test_no_function_over_80_lines_without_a_reason_in_its_docstring() -> None:
    """A function longer than ~80 lines says why in its docstring ("Long because ...")."""
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            docstring = ast.get_docstring(node) or ""
            if length > MAX_LINES and "long because" not in docstring.lower():
                offenders.append(f"{path.relative_to(SRC.parent)}:{node.lineno} {node.name} ({length} lines)")
    assert not offenders, "split these functions or state why they are long in their docstring: " + ", ".join(
        offenders
    )
