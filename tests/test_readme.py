"""The README's Python quickstart runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.usefixtures("shm_leak_check")
def test_python_quickstart_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    quickstart = next(b for b in blocks if "prefix_keys(token_ids" in b)
    namespace: dict[str, object] = {}
    exec(compile(quickstart, str(README), "exec"), namespace)
    mgr = namespace["mgr"]
    assert getattr(mgr, "is_shut_down", False)
    assert namespace["hits"] == [] and namespace["plan"] is not None
