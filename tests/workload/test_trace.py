"""The Mooncake trace reader."""

from __future__ import annotations

import codecs
import gzip
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.workload.trace import FlatTrace, TraceFormatError, TraceRequest, iter_trace, read_trace, trace_summary

REAL_TRACE = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "conversation_trace.jsonl"


def test_reads_requests_sorted_by_timestamp(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 5, "input_length": 700, "output_length": 3, "hash_ids": [0, 1]}\n'
        "\n"
        '{"timestamp": 1, "input_length": 10, "output_length": 0, "hash_ids": [2]}\n'
    )
    reqs = read_trace(path)
    assert [r.timestamp_ms for r in reqs] == [1, 5]
    assert reqs[1].hash_ids == (0, 1)
    assert read_trace(path, limit=1)[0].timestamp_ms == 5
    flat = FlatTrace.from_requests(reqs)
    assert flat.num_requests == 2 and flat.num_refs == 3
    assert flat.request(1).tolist() == [0, 1]
    assert trace_summary(reqs)["distinct_blocks"] == 3


def test_fractional_timestamps_order_the_requests(tmp_path: Path) -> None:
    """Regression (review, 2026-12-05): timestamps were truncated to integers before the sort, so
    0.9, 0.1, 0.5 all became 0 and the requests replayed in file order."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 1, "output_length": 1, "hash_ids": [i]}) + "\n"
                            for i, t in enumerate([0.9, 0.1, 0.5])))  # fmt: skip
    reqs = read_trace(path)
    assert [r.hash_ids for r in reqs] == [(1,), (2,), (0,)]
    assert [r.timestamp_ms for r in reqs] == [0.1, 0.5, 0.9]


def test_limit_never_parses_the_line_after_the_first_n(tmp_path: Path) -> None:
    """Regression (review, 2026-12-05): --limit N read and parsed line N+1 too, so a bad line right
    after the first N requests failed a replay that should never reach it."""
    path = tmp_path / "t.jsonl"
    good = '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n'
    path.write_bytes(good.encode() + b'{"timestamp": NaN}\n' + b"\xff\xfe binary\n")
    assert [r.hash_ids for r in read_trace(path, limit=1)] == [(1,)]
    assert read_trace(path, limit=0) == []
    with pytest.raises(TraceFormatError, match=":2"):
        read_trace(path, limit=2)


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"timestamp": 1, "hash_ids": "abc"}', "'hash_ids' must be a list of integers"),
        ('{"timestamp": 1, "hash_ids": [1, true]}', "'hash_ids' must be a list of integers"),
        ('{"timestamp": -1, "hash_ids": [1]}', "'timestamp' must be a non-negative number"),
        # Regression (review, 2026-12-02): a field named twice kept its last value unnoticed.
        ('{"timestamp": 1, "hash_ids": [1], "hash_ids": [2]}', "key 'hash_ids' appears twice"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, line: str, fragment: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n' + line + "\n")
    with pytest.raises(TraceFormatError) as err:
        list(iter_trace(path))
    assert f"{path}:2" in str(err.value) and fragment in str(err.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        read_trace(tmp_path / "nope.jsonl")


@pytest.mark.skipif(not REAL_TRACE.is_file(), reason="shared Mooncake trace not present")
def test_real_trace_counts() -> None:
    reqs = read_trace(REAL_TRACE)
    summary = trace_summary(reqs)
    assert summary["requests"] == 12031
    assert summary["block_refs"] == 288500
    assert summary["distinct_blocks"] == 182790
    flat = FlatTrace.from_requests(reqs)
    assert flat.ids.dtype == np.int64 and flat.num_refs == 288500


# --------------------------------------------------------------------------- untrusted trace files

GOOD = '{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [0, 1]}\n'


def _line(**fields: object) -> str:
    base: dict[str, object] = {"timestamp": 3, "input_length": 10, "output_length": 2, "hash_ids": [5, 6]}
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not _DROP}) + "\n"


_DROP = object()


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ('{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": [1]}', "NaN is not a number"),
        ('{"timestamp": 1, "input_length": Infinity, "output_length": 1, "hash_ids": [1]}', "Infinity"),
        ('{"timestamp": 1, "input_length": 1, "output_length": -Infinity, "hash_ids": [1]}', "-Infinity"),
        ('{"timestamp": 1e400, "input_length": 1, "output_length": 1, "hash_ids": [1]}', "'timestamp' must be"),
        ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [9223372036854775808]}', "int64"),
        ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [-9223372036854775809]}', "int64"),
        ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1.5]}', "list of integers"),
        ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [' + "9" * 5000 + "]}", "digits"),
        ('{"timestamp": 9223372036854775808, "input_length": 1, "output_length": 1, "hash_ids": [1]}', "2**63"),
        (_line(hash_ids=_DROP).strip(), "missing 'hash_ids'"),
        (_line(timestamp=_DROP).strip(), "missing 'timestamp'"),
        (_line(input_length=_DROP, output_length=_DROP).strip(), "missing 'input_length', 'output_length'"),
        (_line(hash_ids=None).strip(), "missing 'hash_ids'"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"a": ' * 50_000 + "1" + "}" * 50_000, "nested too deeply"),
        ('{"timestamp": 1, "hash_ids": [1]', "not JSON"),
    ],
)
def test_hostile_lines_are_errors_naming_the_line(tmp_path: Path, line: str, fragment: str) -> None:
    """NaN/Infinity, ids beyond int64, missing fields, deep nesting: an error naming file and line, never a crash."""
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + "\n" + line + "\n")
    with pytest.raises(TraceFormatError) as err:
        read_trace(path)
    assert f"{path}:3" in str(err.value) and fragment in str(err.value), str(err.value)


def test_gzip_traces_are_read_natively_whatever_their_name(tmp_path: Path) -> None:
    text = GOOD + _line() + _line(timestamp=1, hash_ids=[0, 7])
    plain = tmp_path / "t.jsonl"
    plain.write_text(text)
    for name in ("t.jsonl.gz", "t.jsonl", "trace"):
        path = tmp_path / "gz" / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(gzip.compress(text.encode()))
        assert read_trace(path) == read_trace(plain)
    assert read_trace(tmp_path / "gz" / "trace", limit=1) == read_trace(plain, limit=1)


@pytest.mark.parametrize("cut", [10, 40, -5])
def test_a_truncated_or_corrupt_gzip_trace_is_an_error_naming_it(tmp_path: Path, cut: int) -> None:
    data = gzip.compress((GOOD * 50).encode())
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(data[:cut] if cut > 0 else data[:cut] + b"\x00" * 3)
    with pytest.raises(ConfigError) as err:
        read_trace(path)
    assert str(path) in str(err.value) and ("gzip" in str(err.value) or "not JSON" in str(err.value)), str(err.value)


def test_a_gzip_bomb_stops_at_the_size_cap(tmp_path: Path) -> None:
    path = tmp_path / "bomb.jsonl.gz"
    path.write_bytes(gzip.compress(GOOD.encode() * 200_000))  # 16 MB of text in ~60 KB
    with pytest.raises(TraceFormatError, match=r"larger than 1.0 MiB.*--limit"):
        list(iter_trace(path, max_bytes=1024**2))
    one_line = tmp_path / "line.jsonl.gz"
    one_line.write_bytes(gzip.compress(b"[" * (17 * 1024**2)))
    with pytest.raises(TraceFormatError, match=r":1: line longer than 16 MiB"):
        read_trace(one_line)


@pytest.mark.parametrize(("data", "where"), [(b"\xff\xfe", "offset 0 (line 1, column 1)"),
                                             (GOOD.encode() + b'{"x": "caf\xe9"}\n',
                                              f"offset {len(GOOD) + 10} (line 2, column 11)")])  # fmt: skip
def test_a_trace_that_is_not_utf8_names_file_and_position(tmp_path: Path, data: bytes, where: str) -> None:
    """Regression: `kvtier replay` raised UnicodeDecodeError."""
    for path, payload in ((tmp_path / "t.jsonl", data), (tmp_path / "t.jsonl.gz", gzip.compress(data))):
        path.write_bytes(payload)
        with pytest.raises(ConfigError) as err:
            read_trace(path)
        assert f"trace '{path}' is not UTF-8" in str(err.value) and where in str(err.value), str(err.value)


def test_a_trace_saved_with_a_byte_order_mark_and_crlf_lines_is_read(tmp_path: Path) -> None:
    """Out-of-sample check (2026-12-05): a trace saved by an editor that marks UTF-8 with a BOM
    (Windows tools, spreadsheet exports) was refused as "not JSON (Unexpected UTF-8 BOM ...)";
    its CRLF line ends and blank lines read as before. A BOM later in the file is still refused."""
    lines = [GOOD.strip(), "", GOOD.strip().replace('"timestamp": 0', '"timestamp": 1')]
    data = codecs.BOM_UTF8 + "\r\n".join(lines).encode() + b"\r\n"
    for path, payload in ((tmp_path / "t.jsonl", data), (tmp_path / "t.jsonl.gz", gzip.compress(data))):
        path.write_bytes(payload)
        assert read_trace(path) == read_trace_text(tmp_path, "\n".join(lines) + "\n")
    (tmp_path / "late.jsonl").write_bytes(GOOD.encode() + codecs.BOM_UTF8 + GOOD.encode())
    with pytest.raises(TraceFormatError, match=r"late.jsonl:2: not JSON"):
        read_trace(tmp_path / "late.jsonl")


def read_trace_text(tmp_path: Path, text: str) -> list[TraceRequest]:
    path = tmp_path / "plain.jsonl"
    path.write_text(text)
    return read_trace(path)


def test_only_regular_trace_files_are_opened(tmp_path: Path, open_fds: Callable[[Path], list[str]]) -> None:
    """Regression: a FIFO hung `kvtier replay`; a link to /dev/zero read until MemoryError."""
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    (tmp_path / "dir.jsonl").mkdir()
    (tmp_path / "real.jsonl").write_text(GOOD)
    (tmp_path / "link.jsonl").symlink_to("real.jsonl")
    for name, kind in (("fifo.jsonl", "a FIFO"), ("zero.jsonl", "a character device"), ("dir.jsonl", "a directory")):
        with pytest.raises(ConfigError, match=kind):
            read_trace(tmp_path / name)
    assert len(read_trace(tmp_path / "link.jsonl")) == 1
    assert open_fds(tmp_path) == []
