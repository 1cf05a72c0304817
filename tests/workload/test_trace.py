"""The Mooncake trace reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.workload.trace import FlatTrace, TraceFormatError, iter_trace, read_trace, trace_summary

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


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"timestamp": 1, "hash_ids": "abc"}', "'hash_ids' must be a list of integers"),
        ('{"timestamp": 1, "hash_ids": [1, true]}', "'hash_ids' must be a list of integers"),
        ('{"timestamp": -1, "hash_ids": [1]}', "'timestamp' must be a non-negative number"),
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
