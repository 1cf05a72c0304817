"""The Python quickstart (docs/index.md, "From Python") runs as written, says what it did and
leaves nothing behind; what the pages state about the manager and the replay is what the code does.

Command blocks marked runnable in the README (the front page) and the docs pages run too: an HTML
comment ``<!-- runnable -->`` right before a fenced block marks it (``<!-- runnable: output -->``:
what the block shows after each command is what it prints). Mark only cheap commands (seconds, no
servers, nothing written outside a temporary directory).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"


def page_section(page: Path, heading: str) -> str:
    """The lines of ``page`` from the heading line ``heading`` up to the next heading of its level or
    above (lines inside fenced blocks, such as shell comments, are not headings)."""
    level = len(heading.split(" ", 1)[0])
    lines = page.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.rstrip("\n") == heading)
    fenced = False
    for end in range(start + 1, len(lines)):
        fenced = fenced != lines[end].startswith("```")
        hashes = len(lines[end]) - len(lines[end].lstrip("#"))
        if not fenced and 1 <= hashes <= level and lines[end][hashes : hashes + 1] == " ":
            return "".join(lines[start:end])
    return "".join(lines[start:])


@pytest.mark.usefixtures("shm_leak_check")
def test_python_quickstart_runs_prints_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: the quickstart printed nothing and left a 34 MB temp dir behind."""
    page = DOCS / "index.md"
    blocks = re.findall(r"```python\n(.*?)```", page_section(page, "## From Python"), flags=re.S)
    quickstart = next(b for b in blocks if "prefix_keys(token_ids" in b)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its temporary directory goes
    namespace: dict[str, object] = {}
    exec(compile(quickstart, str(page), "exec"), namespace)
    mgr = namespace["mgr"]
    assert getattr(mgr, "is_shut_down", False)
    printed = capsys.readouterr().out
    expected = "16 of 62 prompt blocks hit the CPU tier; 16 loaded with the right bytes; the disk tier holds 16 blocks"
    assert printed == expected + "\n"
    assert printed.strip() in " ".join(page.read_text().split())  # the page quotes what it prints
    assert not any(tmp_path.iterdir()), "the quickstart left files behind"


def test_replay_docs_say_where_the_trace_comes_from() -> None:
    """Regression: the replay example named a trace that was nowhere to be found."""
    section = page_section(DOCS / "policies.md", "## `kvtier replay`")
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


def test_docs_list_exactly_the_calls_that_answer_after_shutdown(tmp_path: Path, namespace: Any) -> None:
    """Regression: the README said three calls answer after shutdown(); more do (the code is the truth).
    The sentence lives in docs/index.md ("From Python")."""
    from kvtier import TieringManager
    from kvtier.errors import ManagerClosedError, RegionError

    text = " ".join(page_section(DOCS / "index.md", "## From Python").split())
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


@dataclass(frozen=True)
class RunnableBlock:
    """A fenced block marked runnable: its page, line, language, text, and whether its output is shown."""

    page: Path
    line: int
    language: str
    body: str
    check_output: bool

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


_MARKED = re.compile(r"^<!-- runnable(: output)? -->\n```([a-z]*)\n(.*?)^```$", re.M | re.S)


def runnable_blocks(pages: list[Path]) -> list[RunnableBlock]:
    """Every marked block of ``pages``; a marker not followed by a fenced block is an error."""
    blocks = []
    for page in pages:
        text = page.read_text()
        matched = {m.start() for m in _MARKED.finditer(text)}
        for marker in re.finditer(r"^<!-- runnable", text, re.M):
            assert marker.start() in matched, (
                f"{page}:{text.count(chr(10), 0, marker.start()) + 1}: a runnable "
                "marker must be followed on the next line by a fenced block"
            )
        for m in _MARKED.finditer(text):
            line = text.count("\n", 0, m.start()) + 2
            blocks.append(RunnableBlock(page, line, m.group(2), m.group(3), bool(m.group(1))))
    return blocks


def _pages_with_commands() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


RUNNABLE = runnable_blocks(_pages_with_commands())


def test_the_docs_mark_runnable_blocks() -> None:
    """The run below is not empty: the docs pages hold runnable blocks of both kinds."""
    assert {b.language for b in RUNNABLE} >= {"console", "python"}
    assert any(b.check_output for b in RUNNABLE)


def test_runnable_markers_are_parsed_and_a_stray_marker_is_an_error(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("x\n<!-- runnable: output -->\n```console\n$ echo hi\nhi\n```\n\n```console\n$ false\n```\n")
    (block,) = runnable_blocks([page])
    assert (block.line, block.language, block.check_output) == (3, "console", True)
    assert _console_steps(block.body) == [("echo hi", ["hi"])]
    page.write_text("<!-- runnable -->\n\n```console\n$ false\n```\n")
    with pytest.raises(AssertionError, match="must be followed"):
        runnable_blocks([page])


def _command_env(tmp_path: Path) -> dict[str, str]:
    """The user's PATH with this interpreter's scripts first; no KVTIER_* setting leaks in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["TMPDIR"] = str(tmp_path)
    return env


def _console_steps(body: str) -> list[tuple[str, list[str]]]:
    """``$ command`` lines and the output lines shown after each."""
    steps: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            assert steps, f"output before the first command: {line!r}"
            steps[-1][1].append(line)
    return steps


@pytest.mark.usefixtures("shm_leak_check")
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_runnable_block_runs_as_written(block: RunnableBlock, tmp_path: Path) -> None:
    env = _command_env(tmp_path)
    if block.language == "python":
        done = subprocess.run([sys.executable, "-c", block.body], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path, env=env)  # fmt: skip
        assert done.returncode == 0, f"{block.id}: {done.stderr}"
        printed = " ".join(done.stdout.split())
        assert not printed or printed in " ".join(block.page.read_text().split()), (
            f"{block.id} prints {printed!r}, which its page does not quote"
        )
    elif block.language in ("console", "bash"):
        steps = _console_steps(block.body) if block.language == "console" else [(block.body, [])]
        assert steps, f"{block.id}: no command"
        for command, shown in steps:
            done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120,
                                  cwd=tmp_path, env=env)  # fmt: skip
            assert done.returncode == 0, f"{block.id}: {command}: exit {done.returncode}: {done.stderr}"
            assert "Traceback" not in done.stderr, f"{block.id}: {command}: {done.stderr}"
            if block.check_output:
                assert done.stdout.rstrip("\n").splitlines() == shown, f"{block.id}: {command} printed:\n{done.stdout}"
    else:
        pytest.fail(f"{block.id}: runnable blocks are console, bash or python, not {block.language!r}")
    assert not any(tmp_path.iterdir()), f"{block.id} left files behind: {sorted(p.name for p in tmp_path.iterdir())}"


def test_the_waits_table_names_every_deadline_the_manager_counts() -> None:
    """Every kind the manager counts when a wait reaches its deadline is in the Operations page's
    table, and every kind the table names is one the manager counts (the code is the truth)."""
    section = page_section(DOCS / "operations.md", "## Waits and deadlines")
    manager = "\n".join(p.read_text() for p in (REPO / "src" / "kvtier" / "manager").glob("*.py"))
    counted = set(re.findall(r'"(\w+_expired|job_overdue|withheld)"', manager))
    assert counted == {"retry_expired", "load_expired", "store_expired", "job_overdue", "cascade_expired", "withheld"}
    named = set(re.findall(r"`(\w+_expired|job_overdue|withheld)`", section))
    assert named == counted
    for setting in ("wait_timeout", "failed_load_seconds", "drain_timeout", "shutdown_timeout"):
        assert f"`{setting}`" in section
