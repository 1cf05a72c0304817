"""Reader for Mooncake-format request traces (JSON lines).

Each line is one request::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52,
     "hash_ids": [46, 47, 48, ...]}

``timestamp`` is the arrival time in milliseconds; ``hash_ids`` is the prompt as
a chain of fixed-size token blocks (512 tokens in the published traces) where
equal ids mean equal prefixes up to and including that block. The last block
may be partial; it is still one block reference.

Pure functions; safe from any thread.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.errors import ConfigError

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in the published Mooncake traces."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class TraceFormatError(ConfigError):
    """A trace line is not a valid Mooncake request; the message names the line."""


def _parse_line(line: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of integers, got {ids!r:.80}")
    values = {}
    for name in ("timestamp", "input_length", "output_length"):
        value = obj.get(name, 0)
        if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
            raise TraceFormatError(f"{where}: {name!r} must be a non-negative number, got {value!r}")
        values[name] = int(value)
    return TraceRequest(values["timestamp"], values["input_length"], values["output_length"], tuple(ids))


def iter_trace(path: str | os.PathLike[str]) -> Iterator[TraceRequest]:
    """Yield the requests of a JSON-lines trace in file order; blank lines are skipped.

    Raises :class:`TraceFormatError` naming the file and line of the first bad line,
    and :class:`ConfigError` if the file cannot be opened.
    """
    name = os.fspath(path)
    try:
        handle = open(name, encoding="utf-8")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise ConfigError(f"trace {name!r} cannot be read: {exc.strerror or exc}") from None
    with handle:
        for lineno, line in enumerate(handle, 1):
            if line.strip():
                yield _parse_line(line, f"{name}:{lineno}")


def read_trace(path: str | os.PathLike[str], limit: int | None = None) -> list[TraceRequest]:
    """All requests of a trace (the first ``limit`` if given), sorted by timestamp (stable)."""
    out: list[TraceRequest] = []
    for req in iter_trace(path):
        if limit is not None and len(out) >= limit:
            break
        out.append(req)
    out.sort(key=lambda r: r.timestamp_ms)
    return out


@dataclass(frozen=True)
class FlatTrace:
    """A trace flattened for fast simulation.

    ``ids[starts[i]:starts[i+1]]`` are the block ids of request ``i``; ``ids`` is
    an int64 array of every block reference in arrival order.
    """

    ids: np.ndarray
    starts: np.ndarray

    @property
    def num_requests(self) -> int:
        return len(self.starts) - 1

    @property
    def num_refs(self) -> int:
        return len(self.ids)

    def request(self, i: int) -> np.ndarray:
        return self.ids[self.starts[i] : self.starts[i + 1]]

    @classmethod
    def from_requests(cls, requests: Sequence[TraceRequest]) -> FlatTrace:
        lengths = np.fromiter((len(r.hash_ids) for r in requests), dtype=np.int64, count=len(requests))
        starts = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        ids = np.fromiter((i for r in requests for i in r.hash_ids), dtype=np.int64, count=int(starts[-1]))
        return cls(ids=ids, starts=starts)


def trace_summary(requests: Sequence[TraceRequest]) -> dict[str, float]:
    """Counts that describe a trace: requests, block references, distinct blocks, duration."""
    refs = sum(len(r.hash_ids) for r in requests)
    distinct = len({i for r in requests for i in r.hash_ids})
    duration = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000 if requests else 0.0
    return {
        "requests": len(requests),
        "block_refs": refs,
        "distinct_blocks": distinct,
        "duration_s": duration,
        "input_tokens": sum(r.input_length for r in requests),
    }
