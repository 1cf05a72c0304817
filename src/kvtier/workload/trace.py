"""Reader for Mooncake-format request traces (JSON lines).

Each line is one request::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52,
     "hash_ids": [46, 47, 48, ...]}

All four fields are required. ``timestamp`` is the arrival time in
milliseconds; ``hash_ids`` is the prompt as a chain of fixed-size token blocks
(512 tokens in the published traces) where equal ids mean equal prefixes up to
and including that block. The last block may be partial; it is still one block
reference.

Traces may be gzip-compressed (``trace.jsonl.gz``, as traces ship); see
:func:`iter_trace` for what is read and what is refused. Functions without
state; safe from any thread.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import zlib
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from kvtier.errors import ConfigError
from kvtier.units import format_size
from kvtier.user_files import decode_utf8, open_input, unique_keys

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in the published Mooncake traces."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    timestamp_ms: float
    """When it arrived, in milliseconds, as the trace gives it (an int, or a fraction of one)."""
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class TraceFormatError(ConfigError):
    """A trace line is not a valid Mooncake request; the message names the line."""


MAX_TRACE_BYTES = 8 * 1024**3
"""The most bytes of trace text read (after decompression): the published traces are a few MB."""

MAX_LINE_BYTES = 16 * 1024**2
"""The longest line read (a request of two million blocks)."""

_INT64 = 2**63
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_GZIP_MAGIC = b"\x1f\x8b"


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number")


def _parse_line(line: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(line, parse_constant=_reject_constant, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise TraceFormatError(f"{where}: values nested too deeply to be a trace request") from None
    except ValueError as exc:  # NaN, Infinity, or an integer of more than 4300 digits
        if "digits" in str(exc):
            raise TraceFormatError(f"{where}: an integer of thousands of digits: numbers must be below 2**63") from None
        if "appears twice" in str(exc):
            raise TraceFormatError(f"{where}: {exc}: give each field once") from None
        raise TraceFormatError(f"{where}: {exc}: use finite numbers") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ids = obj.get("hash_ids")
    if ids is not None and (
        not isinstance(ids, list) or not all(type(i) is int and -_INT64 <= i < _INT64 for i in ids)  # no bools
    ):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of integers in the int64 range, got {ids!r:.80}")
    values: dict[str, int | float] = {}
    for name in _FIELDS[:3]:
        value = obj.get(name)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < _INT64:
            raise TraceFormatError(
                f"{where}: {name!r} must be a non-negative number (finite, below 2**63), got {value!r:.40}"
            )
        # The lengths are counts; the timestamp keeps its fraction: requests are replayed in its order.
        values[name] = value if name == "timestamp" else int(value)
    missing = [name for name in _FIELDS if obj.get(name) is None]
    if missing:
        raise TraceFormatError(
            f"{where}: missing {', '.join(repr(m) for m in missing)}: each line needs {', '.join(_FIELDS)}"
        )
    return TraceRequest(values["timestamp"], int(values["input_length"]), int(values["output_length"]),
                        tuple(ids or ()))  # fmt: skip


def _lines(raw: BinaryIO, name: str, max_bytes: int) -> Iterator[tuple[int, int, bytes]]:
    """(line number, file offset, bytes) of each line of ``raw``, gunzipped if it starts like gzip."""
    stream: BinaryIO = raw
    if isinstance(raw, io.BufferedReader) and raw.peek(2)[:2] == _GZIP_MAGIC:
        stream = gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[assignment]
    offset = 0
    lineno = 0
    with stream:
        while True:
            try:
                line = stream.readline(MAX_LINE_BYTES + 1)
            except (OSError, EOFError, zlib.error) as exc:
                what = "gzip data" if stream is not raw else "file"
                detail = " ".join(str(exc).split())[:120] or type(exc).__name__
                raise TraceFormatError(f"{name}:{lineno + 1}: the {what} cannot be read ({detail})") from None
            if not line:
                return
            lineno += 1
            if len(line) > MAX_LINE_BYTES:
                raise TraceFormatError(
                    f"{name}:{lineno}: line longer than {MAX_LINE_BYTES // 1024**2} MiB: not a trace request"
                )
            if offset + len(line) > max_bytes:
                raise TraceFormatError(
                    f"{name}:{lineno}: the trace is larger than {format_size(max_bytes)}, the most read here "
                    "(a replay holds about 8 bytes of memory per byte of trace): replay a part of it (--limit N)"
                )
            yield lineno, offset, line
            offset += len(line)


def iter_trace(
    path: str | os.PathLike[str], *, max_bytes: int = MAX_TRACE_BYTES
) -> Generator[TraceRequest, None, None]:
    """Yield the requests of a JSON-lines trace in file order; blank lines are skipped.

    The file must be a regular file (a FIFO or device is refused, never read; a
    symlink to a regular file is fine), plain or gzip-compressed (recognized by
    its first bytes, whatever its name), UTF-8 (a leading byte order mark is
    skipped), with lines of at most :data:`MAX_LINE_BYTES` and at most
    ``max_bytes`` in all (decompressed). Each
    line must be an object with ``timestamp``, ``input_length``,
    ``output_length`` (finite, non-negative numbers) and ``hash_ids`` (integers
    in the int64 range). Raises :class:`TraceFormatError` naming the file and
    line of the first problem, and :class:`ConfigError` if the file cannot be opened.
    """
    name = os.fspath(path)
    raw = os.fdopen(open_input(name, "trace"), "rb")
    with raw:
        for lineno, offset, line in _lines(raw, name, max_bytes):
            text = decode_utf8(line, "trace", name, start_offset=offset, line=lineno)
            if lineno == 1:  # a UTF-8 BOM (Windows editors write one), as config files skip it
                text = text.removeprefix("\ufeff")
            if text.strip():
                yield _parse_line(text, f"{name}:{lineno}")


def read_trace(
    path: str | os.PathLike[str], limit: int | None = None, *, max_bytes: int = MAX_TRACE_BYTES
) -> list[TraceRequest]:
    """All requests of a trace (the first ``limit`` if given), sorted by timestamp (stable).

    See :func:`iter_trace` for what is read and refused (``max_bytes``: the most
    text read); with ``limit`` the rest of the file is never read.
    """
    out: list[TraceRequest] = []
    if limit is not None and limit <= 0:
        return out
    with contextlib.closing(iter_trace(path, max_bytes=max_bytes)) as requests:
        for req in requests:
            out.append(req)
            if limit is not None and len(out) >= limit:
                break  # before the next line is read: a bad line after the first ``limit`` is never parsed
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
