"""The README's Python quickstart runs as written, says what it did and leaves nothing behind."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

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


def _after_shutdown_calls(mgr: object, key: bytes) -> dict[str, object]:
    """One call per public method and property of the manager, with plausible arguments."""
    from kvtier import RequestContext

    req = RequestContext("r")
    m: Any = mgr
    return {
        "lookup": lambda: m.lookup(key, req), "lookup_prefix": lambda: m.lookup_prefix([key], req),
        "prepare_load": lambda: m.prepare_load([key], req), "complete_load": lambda: m.complete_load([key], req),
        "touch": lambda: m.touch([key], req), "prepare_store": lambda: m.prepare_store([key], req),
        "complete_store": lambda: m.complete_store([key], req), "on_new_request": lambda: m.on_new_request(req),
        "on_request_finished": lambda: m.on_request_finished(req), "on_schedule_end": lambda: m.on_schedule_end(),
        "has_pending_work": lambda: m.has_pending_work(), "take_events": lambda: m.take_events(),
        "jobs_in_flight": lambda: m.jobs_in_flight(), "reset_cache": lambda: m.reset_cache(),
        "request_control": lambda: m.request_control(req), "tier_descriptors": lambda: m.tier_descriptors(),
        "tier_label": lambda: m.tier_label(1), "stats": lambda: m.stats(), "shutdown": lambda: m.shutdown(),
        "is_shut_down": lambda: m.is_shut_down, "is_idle": lambda: m.is_idle, "telemetry": lambda: m.telemetry,
        "block_bytes": lambda: m.block_bytes, "rows": lambda: m.rows, "region": lambda: m.region,
    }  # fmt: skip


def test_readme_lists_exactly_the_calls_that_answer_after_shutdown(tmp_path: Path, namespace: Any) -> None:
    """Regression: the README said three calls answer after shutdown(); more do (the code is the truth)."""
    from kvtier import TieringManager
    from kvtier.errors import ManagerClosedError, RegionError

    text = " ".join(README.read_text().split())
    sentence = text[text.index("After `shutdown()`, the calls that only read") :]
    sentence = sentence[: sentence.index("raises `ManagerClosedError`")]
    answering_doc, closed_doc = sentence.split("every other method")
    answering_doc = answering_doc[: answering_doc.index("`rows` raises")]
    documented = {name.removesuffix("()") for name in re.findall(r"`([a-z_]+(?:\(\))?)`", answering_doc)}
    refused_doc = {name.removesuffix("()") for name in re.findall(r"`([a-z_]+(?:\(\))?)`", closed_doc)}
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=4, shm_dir=tmp_path,
                                tiers=[{"type": "memory", "max_bytes": 1 << 20}])  # fmt: skip
    mgr.shutdown()
    calls = _after_shutdown_calls(mgr, b"k" * 32)
    public = {n for n in dir(TieringManager) if not n.startswith("_")} - {"create"}
    assert public <= set(calls), f"public calls without a check here: {public - set(calls)}"
    answered, refused, other = set(), set(), {}
    for name, call in calls.items():
        try:
            call()  # type: ignore[operator]
            answered.add(name)
        except ManagerClosedError:
            refused.add(name)
        except RegionError as exc:
            other[name] = exc
    assert documented == answered, documented ^ answered
    assert refused_doc == refused
    assert set(other) == {"rows"} and "`rows` raises `RegionError`" in sentence
