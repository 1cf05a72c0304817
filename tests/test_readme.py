"""The README's Python quickstart runs as written, says what it did and leaves nothing behind."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.usefixtures("shm_leak_check")
def test_python_quickstart_runs_prints_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: the quickstart printed nothing and left a 34 MB temp dir behind."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    quickstart = next(b for b in blocks if "prefix_keys(token_ids" in b)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its temporary directory goes
    namespace: dict[str, object] = {}
    exec(compile(quickstart, str(README), "exec"), namespace)
    mgr = namespace["mgr"]
    assert getattr(mgr, "is_shut_down", False)
    printed = capsys.readouterr().out
    expected = "16 of 62 prompt blocks hit the CPU tier; 16 loaded with the right bytes; the disk tier holds 16 blocks"
    assert printed == expected + "\n"
    assert printed.strip() in " ".join(README.read_text().split())  # the README quotes what it prints
    assert not any(tmp_path.iterdir()), "the quickstart left files behind"


def test_readme_says_where_the_replay_trace_comes_from() -> None:
    """Regression: the replay example named a trace that was nowhere to be found."""
    text = README.read_text()
    section = text[text.index("## Sizing tiers with real traces") :]
    section = section[: section.index("\n## ", 1)]
    assert "conversation_trace.jsonl" in section
    assert "Mooncake" in section and "FAST'25" in section
    raw = "https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/conversation_trace.jsonl"
    assert raw in section
