"""Per-request control: what one request lets kvtier do with its blocks.

A request carries its settings in :attr:`RequestContext.params` (under vLLM:
the request's ``kv_transfer_params``). The keys:

``kvtier_load_tiers``
    The tiers this request may load blocks from: a list of selectors (or one
    selector). Blocks held only in other tiers count as misses for it (they
    are recomputed, never promoted for it). Default: every tier.
``kvtier_store``
    ``false``: this request's blocks are not offloaded at all (neither to the
    CPU tier nor beyond), e.g. for a one-off prompt. Default ``true``.
``kvtier_cascade_tiers``
    The secondary tiers the blocks this request stores are cascaded to (a list
    of selectors); ``[]`` keeps them in the CPU tier only. Default: every tier.

Application hints (what a serving stack knows about a request's future; the
eviction policy may use them, ``return-time`` does, ``lru`` and ``arc`` ignore them):

``kvtier_session``
    The id of the conversation (session) the request belongs to: a string of 1 to
    128 printable characters. Default: none.
``kvtier_session_end``
    ``true``: the conversation ended with this request; nothing will extend it, so
    its own blocks are evicted first. Default ``false``.
``kvtier_expected_return_s``
    When the client expects to send the conversation's next request, in seconds
    after this one: a number from 0 to 86400. Default: unknown.

A selector names tiers: ``"cpu"`` (also ``"primary"``, ``"0:primary"``) for the
CPU tier, a label such as ``"1:fs"``, a tier type such as ``"fs"`` or
``"redis"`` (every tier of that type), ``"local"`` or ``"remote"`` (by where a
tier keeps its data: the CPU tier and disk tiers are local, Redis and S3
remote), or ``"all"``. Excluding the CPU tier from ``kvtier_load_tiers`` means
nothing is loaded for the request (every block is the gateway's).

The params are client input (an HTTP client writes ``kv_transfer_params``): a
malformed value costs nothing after the call that parses it. Messages show a value by
its type, size and a bounded repr (:func:`describe_value`), never the value itself,
and :class:`ControlProblemLog` keeps counts per key and kind of problem (a fixed,
small set), never the messages or the values.

Pure functions and one counter; the manager parses a request's params once, on
first use, from its scheduler thread.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import BoundedRepr, ConfigError
from kvtier.types import PRIMARY_LABEL, RequestControl, RequestHints

LOAD_TIERS_KEY = "kvtier_load_tiers"
STORE_KEY = "kvtier_store"
CASCADE_TIERS_KEY = "kvtier_cascade_tiers"
SESSION_KEY = "kvtier_session"
SESSION_END_KEY = "kvtier_session_end"
EXPECTED_RETURN_KEY = "kvtier_expected_return_s"
CONTROL_KEYS = (LOAD_TIERS_KEY, STORE_KEY, CASCADE_TIERS_KEY, SESSION_KEY, SESSION_END_KEY, EXPECTED_RETURN_KEY)
MAX_SESSION_CHARS = 128
MAX_EXPECTED_RETURN_S = 86400.0

_CPU_NAMES = frozenset({"cpu", "primary", PRIMARY_LABEL})
_LOCALITIES = frozenset({"local", "remote"})
_SHOWN_CHARS = 80


_SHORT = BoundedRepr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxset = 2, 4, 4, 3, 4
_SHORT.maxstring, _SHORT.maxlong, _SHORT.maxother = 40, 40, 40


def describe_value(value: Any) -> str:
    """A client's value for a message, bounded whatever it is: a short scalar as its repr,
    anything longer by type and size with the start of its repr (``a list of 200000 items:
    [1, 2, 3, 4, ...]``). Never raises, never more than about 130 characters."""
    if value is None or isinstance(value, bool | float):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, str):
        return repr(value) if len(value) <= _SHOWN_CHARS // 2 else f"a string of {len(value)} characters"
    if isinstance(value, bytes | bytearray):
        return f"{len(value)} bytes"
    if not isinstance(value, list | tuple | dict | set | frozenset):
        return f"a {type(value).__name__} object"  # not JSON: its repr is not called at all
    shown = _SHORT.repr(value)
    shown = shown if len(shown) <= _SHOWN_CHARS else shown[: _SHOWN_CHARS - 4] + " ..."
    return f"a {type(value).__name__} of {len(value)} items: {shown}"


class RequestControlError(ConfigError):
    """A request's kvtier setting is malformed; the message names the key, the value and the choices."""


@dataclass(frozen=True)
class TierDescriptor:
    """What a selector can match of one tier: index (0 = CPU tier), label, type and locality."""

    index: int
    label: str
    tier_type: str
    locality: str


def tier_locality(medium: str, declared: object = None) -> str:
    """``"local"`` or ``"remote"``: a tier's declared ``locality``, else ``remote`` for the
    ``remote`` medium and ``local`` for every other (cpu, disk, memory)."""
    if isinstance(declared, str) and declared.lower() in _LOCALITIES:
        return declared.lower()
    return "remote" if medium == "remote" else "local"


def _shown_id(req_id: object) -> str:
    """A request id for a log line: short, printable, whatever the engine passed."""
    text = str.__str__(req_id) if isinstance(req_id, str) else repr(req_id)
    return text if len(text) <= 64 and text.isprintable() else ascii(text[:61])[1:-1] + "..."


# An engine has a handful of tiers: a longer list, or a longer name, is malformed, and refused
# before the scheduler thread spends time in proportion to what a client sent.
MAX_SELECTORS = 64
MAX_SELECTOR_CHARS = 256


def select_tiers(key: str, raw: Any, tiers: Sequence[TierDescriptor]) -> frozenset[int]:
    """The indices of ``tiers`` that the selectors ``raw`` (a string or a list of them) name.

    Raises :class:`RequestControlError` for anything else, naming the selectors
    this engine's tiers offer.
    """
    items = [raw] if isinstance(raw, str) else raw
    if (
        not isinstance(items, list | tuple) or len(items) > MAX_SELECTORS
        or not all(isinstance(i, str) and len(i) <= MAX_SELECTOR_CHARS for i in items)
    ):  # fmt: skip
        raise RequestControlError(
            f"{key} must be a list of tier selectors (at most {MAX_SELECTORS} strings of at most "
            f"{MAX_SELECTOR_CHARS} characters), got {describe_value(raw)}: e.g. [\"cpu\", \"fs\"]"
        )
    chosen: set[int] = set()
    for item in items:
        name = str.lower(str.strip(item))  # str's own methods: a str subclass's are the client's
        if name == "all":
            matched = {t.index for t in tiers}
        elif name in _CPU_NAMES:
            matched = {0}
        elif name in _LOCALITIES:
            matched = {t.index for t in tiers if t.locality == name}
        else:
            matched = {t.index for t in tiers if name in (t.label.lower(), t.tier_type.lower())}
            if not matched:
                known = sorted({"cpu", "all", "local", "remote"} | {n for t in tiers for n in (t.label, t.tier_type)})
                raise RequestControlError(
                    f"{key} names {describe_value(item)}, which is no tier of this engine: use one of {known}"
                )
        chosen |= matched
    return frozenset(chosen)


@dataclass(frozen=True)
class ControlProblem:
    """One malformed setting of a request: the key, the kind of problem (``"not_selectors"``,
    ``"unknown_selector"``, ``"not_boolean"``, ``"not_session_id"``, ``"not_seconds"``) and a
    bounded message."""

    key: str
    kind: str
    message: str


def parse_control_problems(
    params: Mapping[str, Any], tiers: Sequence[TierDescriptor]
) -> tuple[RequestControl, list[ControlProblem]]:
    """The :class:`RequestControl` that ``params`` ask for, and one problem per malformed key.

    A malformed key falls back to its default (the others still apply). ``tiers``
    describes every tier, the CPU tier first. Keeps no reference to ``params``.
    """
    problems: list[ControlProblem] = []
    load_from: frozenset[int] | None = None
    cascade_to: frozenset[int] | None = None
    store = True
    raw = params.get(LOAD_TIERS_KEY)
    if raw is not None:
        try:
            load_from = select_tiers(LOAD_TIERS_KEY, raw, tiers)
        except RequestControlError as exc:
            problems.append(_problem(LOAD_TIERS_KEY, exc))
    store = _boolean(params, STORE_KEY, True, problems)
    raw = params.get(CASCADE_TIERS_KEY)
    if raw is not None:
        try:
            cascade_to = select_tiers(CASCADE_TIERS_KEY, raw, tiers) - {0}
        except RequestControlError as exc:
            problems.append(_problem(CASCADE_TIERS_KEY, exc))
    if load_from is not None and load_from >= {t.index for t in tiers}:
        load_from = None
    if cascade_to is not None and cascade_to >= {t.index for t in tiers if t.index}:
        cascade_to = None
    hints = parse_hints(params, problems)
    return RequestControl(load_from=load_from, store=store, cascade_to=cascade_to, hints=hints), problems


def _boolean(params: Mapping[str, Any], key: str, default: bool, problems: list[ControlProblem]) -> bool:
    raw = params.get(key)
    if raw is None:
        return default
    if isinstance(raw, bool):
        return raw
    _malformed(problems, key, "not_boolean", "true or false", raw)
    return default


def _malformed(problems: list[ControlProblem], key: str, kind: str, wants: str, raw: Any) -> None:
    problems.append(ControlProblem(key, kind, f"{key} must be {wants}, got {describe_value(raw)}"))


def parse_hints(params: Mapping[str, Any], problems: list[ControlProblem]) -> RequestHints | None:
    """The application hints in ``params`` (None: none, or none well formed); one problem per
    malformed key is appended to ``problems`` (its value is not kept)."""
    session: str | None = None
    raw = params.get(SESSION_KEY)
    if raw is not None:
        # A str subclass's methods are the client's: check and keep a plain str.
        text = (raw if type(raw) is str else str.__str__(raw)) if isinstance(raw, str) else None
        if text is not None and 0 < len(text) <= MAX_SESSION_CHARS and text.isprintable():
            session = text
        else:
            wants = f"a string of 1 to {MAX_SESSION_CHARS} printable characters"
            _malformed(problems, SESSION_KEY, "not_session_id", wants, raw if text is None else text)
    ended = _boolean(params, SESSION_END_KEY, False, problems)
    expected: float | None = None
    raw = params.get(EXPECTED_RETURN_KEY)
    if raw is not None:
        # Plain JSON numbers only (a subclass's __float__ is the client's; a huge int overflows float()).
        number = type(raw) is float or (type(raw) is int and raw.bit_length() <= 64)
        seconds = float(raw) if number else math.nan
        if 0.0 <= seconds <= MAX_EXPECTED_RETURN_S:  # NaN fails both
            expected = seconds
        else:
            wants = f"a number of seconds from 0 to {MAX_EXPECTED_RETURN_S:g}"
            _malformed(problems, EXPECTED_RETURN_KEY, "not_seconds", wants, raw)
    if session is None and not ended and expected is None:
        return None
    return RequestHints(session, ended, expected)


def _problem(key: str, exc: RequestControlError) -> ControlProblem:
    message = str(exc)
    exc.__traceback__ = None  # its frames hold the client's value
    return ControlProblem(key, "unknown_selector" if " names " in message else "not_selectors", message)


def parse_control(params: Mapping[str, Any], tiers: Sequence[TierDescriptor]) -> tuple[RequestControl, list[str]]:
    """:func:`parse_control_problems` with the problems as messages."""
    control, problems = parse_control_problems(params, tiers)
    return control, [p.message for p in problems]


class ControlProblemLog:
    """Counts malformed request settings per key and kind of problem, and logs a few.

    The first problem of each kind is logged, then the 10th, 100th, 1000th... (with the
    count so far): the log and the memory stay bounded however many requests a client
    sends, and only counts are kept (a fixed, small set of them). Scheduler thread only.
    """

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._counts: dict[tuple[str, str], int] = {}

    def record(self, req_id: str, problems: Sequence[ControlProblem]) -> None:
        for problem in problems:
            kind = (problem.key, problem.kind)
            n = self._counts.get(kind, 0) + 1
            self._counts[kind] = n
            if str(n).rstrip("0") == "1":  # 1, 10, 100, ...
                self._log.warning(
                    "request %s: %s; that setting is ignored (%d such problem(s) so far)",
                    _shown_id(req_id),
                    problem.message, n,
                )  # fmt: skip

    def counts(self) -> dict[str, int]:
        """``{"<key>:<kind>": count}`` of every problem seen so far."""
        return {f"{key}:{kind}": n for (key, kind), n in self._counts.items()}


__all__ = [
    "CASCADE_TIERS_KEY",
    "CONTROL_KEYS",
    "EXPECTED_RETURN_KEY",
    "LOAD_TIERS_KEY",
    "MAX_EXPECTED_RETURN_S",
    "MAX_SESSION_CHARS",
    "SESSION_END_KEY",
    "SESSION_KEY",
    "STORE_KEY",
    "ControlProblem",
    "ControlProblemLog",
    "RequestControlError",
    "TierDescriptor",
    "describe_value",
    "parse_control",
    "parse_control_problems",
    "parse_hints",
    "select_tiers",
    "tier_locality",
]
