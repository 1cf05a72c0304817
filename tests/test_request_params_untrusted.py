"""Request parameters are client input: a malformed value costs O(1) memory after the call.

An HTTP client writes ``kv_transfer_params``. Whatever it sends under kvtier's keys
(huge lists, long strings, deep nesting, huge integers, objects with hostile
``__repr__``), the manager keeps no copy, no message grows with it, and the
bookkeeping of problems is counts per key and kind, bounded however many distinct
bad requests arrive. Measured with tracemalloc; retention checked by reference
counts and weak references.
"""

from __future__ import annotations

import gc
import logging
import sys
import tracemalloc
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import Namespace, RequestContext, TieringManager
from kvtier.metrics import KvtierMetrics
from kvtier.request_control import CASCADE_TIERS_KEY, CONTROL_KEYS, LOAD_TIERS_KEY, STORE_KEY


class Hostile:
    """A Python-API caller's object: repr and len raise, and it can be weakly referenced."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")

    def __len__(self) -> int:
        raise RuntimeError("no len either")


def _nested(depth: int) -> list[Any]:
    value: list[Any] = ["fs"]
    for _ in range(depth):
        value = [value]
    return value


# Each maker builds the i-th distinct malformed value of one shape.
SHAPES: dict[str, Callable[[int], Any]] = {
    "200k-item list": lambda i: list(range(i, i + 200_000)),
    "200k unknown selectors": lambda i: [f"tier-{i}-{j}" for j in range(200_000)],
    "100k-key dict": lambda i: {f"k{j}": i for j in range(100_000)},
    "1 MB string": lambda i: f"{i}:" + "x" * 1_000_000,
    "1 MB selector": lambda i: ["cpu", f"{i}" + "y" * 1_000_000],
    "huge int": lambda i: 10**5000 + i,
    "deep nesting": lambda i: _nested(500 + i % 7),
    "list of 100k dicts": lambda i: [{"n": i, "v": "z" * 10} for _ in range(100_000)],
    "bytes": lambda i: bytes(1_000_000) + i.to_bytes(4, "big"),
    "float": lambda i: float("nan") if i % 2 else 1e308 * (i + 1),
    "hostile object": lambda i: Hostile(),
}


@pytest.fixture
def mgr(namespace: Namespace, private_shm: Path) -> Iterator[TieringManager]:
    manager = TieringManager.create(
        namespace=namespace, num_cpu_blocks=8, shm_dir=private_shm, tiers=[{"type": "memory", "max_bytes": "1MiB"}]
    )
    yield manager
    manager.shutdown()


def _control(mgr: TieringManager, req_id: str, params: dict[str, Any]) -> None:
    ctx = RequestContext(req_id, params)
    mgr.request_control(ctx)
    del ctx


@pytest.mark.parametrize("key", CONTROL_KEYS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_malformed_value_is_not_kept_and_its_message_is_bounded(
    mgr: TieringManager, shape: str, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    value = SHAPES[shape](0)
    before = sys.getrefcount(value)
    probe = weakref.ref(value) if isinstance(value, Hostile) else None
    with caplog.at_level(logging.WARNING):
        _control(mgr, "r0", {key: value})
    gc.collect()
    assert sys.getrefcount(value) == before, f"something kept a reference to the client's {shape}"
    messages = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert messages, "a malformed setting must be logged"
    assert all(len(m) < 400 for m in messages), max(messages, key=len)[:500]
    assert all(r.args is None or all(isinstance(a, str | int) for a in r.args) for r in caplog.records)
    if probe is not None:
        del value
        gc.collect()
        assert probe() is None, "the hostile object outlived the call"


DISTINCT: dict[str, Callable[[int], Any]] = {
    "2k-item lists": lambda i: list(range(i, i + 2_000)),
    "20 KB strings": lambda i: f"{i}:" + "x" * 20_000,
    "20 KB selectors": lambda i: ["cpu", f"{i}" + "y" * 20_000],
    "1 KB unknown selectors": lambda i: ["cpu", f"tier-{i}-" + "q" * 1_000],
    "2k-key dicts": lambda i: dict.fromkeys(range(i, i + 2_000), i),
}


def _retained(mgr: TieringManager, requests: int, make: Callable[[int], Any]) -> int:
    """Bytes still allocated after ``requests`` distinct bad requests (values dropped by the caller)."""
    for i in range(20):  # warm-up: the first problem of each kind is logged, caches fill
        _control(mgr, f"warm-{i}", {LOAD_TIERS_KEY: make(i), STORE_KEY: make(i), CASCADE_TIERS_KEY: make(i)})
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.take_snapshot()
        for i in range(20, 20 + requests):
            value = make(i)
            _control(mgr, f"req-{i}-" + "r" * 100, {LOAD_TIERS_KEY: value, STORE_KEY: value, CASCADE_TIERS_KEY: value})
            del value
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    return sum(stat.size_diff for stat in after.compare_to(base, "filename"))


@pytest.mark.parametrize("shape", list(DISTINCT))
def test_thousands_of_distinct_bad_requests_cost_bounded_memory(mgr: TieringManager, shape: str) -> None:
    """2,000 distinct bad requests: what the manager retains afterwards does not grow with
    them (the old code kept 1,024 distinct messages, each holding the whole value's repr:
    10-40 MB for these shapes, GBs for larger values)."""
    grown = _retained(mgr, 2_000, DISTINCT[shape])
    assert grown < 64 * 1024, f"{grown} bytes retained after 2,000 bad requests of {shape}"


def test_a_200k_item_list_costs_nothing_after_the_call(mgr: TieringManager) -> None:
    grown = _retained(mgr, 3, SHAPES["200k-item list"])
    assert grown < 16 * 1024, f"{grown} bytes retained after three 200,000-item lists"


def test_problems_are_counted_per_kind_and_logged_at_1_10_100(
    mgr: TieringManager, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        for i in range(150):
            _control(mgr, f"r{i}", {CASCADE_TIERS_KEY: [f"nope-{i}"], STORE_KEY: i})
    counts = mgr._requests._control_problems.counts()  # the request table (kvtier.manager.requests) keeps them
    assert counts == {f"{CASCADE_TIERS_KEY}:unknown_selector": 150, f"{STORE_KEY}:not_boolean": 150}
    logged = [r.getMessage() for r in caplog.records if "setting is ignored" in r.getMessage()]
    assert len(logged) == 6, logged  # 1st, 10th, 100th of each kind
    assert any("(100 such problem(s) so far)" in m for m in logged)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        pytest.param("no", "'no'", id="short string"),
        pytest.param(list(range(200_000)), "a list of 200000 items: [0, 1, 2, 3, ...]", id="long list"),
        pytest.param("x" * 10_000, "a string of 10000 characters", id="long string"),
        pytest.param(10**5000, "an integer of 16610 bits", id="huge int"),
        pytest.param(Hostile(), "a Hostile object", id="hostile"),
        pytest.param(bytes(10_000), "10000 bytes", id="bytes"),
        pytest.param(_nested(1000), "a list of 1 items: [[[...]]]", id="deep"),
    ],
)
def test_values_are_described_by_type_and_a_bounded_repr(value: Any, shown: str) -> None:
    from kvtier.request_control import describe_value

    assert describe_value(value) == shown


def test_problem_counts_are_in_the_snapshot_and_the_metrics(mgr: TieringManager) -> None:
    for i in range(3):
        _control(mgr, f"r{i}", {CASCADE_TIERS_KEY: [f"nope-{i}"], STORE_KEY: i})
    _control(mgr, "r-list", {CASCADE_TIERS_KEY: list(range(200_000))})
    snap = mgr.stats()
    counts = snap.manager.request_control_problems
    assert counts == mgr._requests._control_problems.counts() and counts[f"{STORE_KEY}:not_boolean"] == 3
    assert snap.as_dict()["manager"]["request_control_problems"] == counts
    metrics = KvtierMetrics()
    metrics.update(snap)
    text = metrics.render().decode()
    for name, count in counts.items():
        key, _, kind = name.partition(":")
        assert f'kvtier_request_control_problems_total{{key="{key}",kind="{kind}"}} {float(count)}' in text
    metrics.update(snap.as_dict())  # the mapping form carries them too
    assert metrics.render().decode() == text


class _ClientStr(str):
    """A str subclass whose methods are the client's: they must never run."""

    def strip(self, *args: Any) -> str:
        raise AssertionError("the client's str method ran")

    def lower(self) -> str:
        raise AssertionError("the client's str method ran")


@pytest.mark.parametrize(
    "request_",
    [
        RequestContext("selector-subclass", {LOAD_TIERS_KEY: [_ClientStr("cpu")]}),
        RequestContext("params-a-str", "kvtier_store=false"),  # type: ignore[arg-type]
        RequestContext(7, {STORE_KEY: "no"}),  # type: ignore[arg-type]
        RequestContext("params-an-array", np.array([1, 2])),  # type: ignore[arg-type]  # its truth test raises
    ],
    ids=["selector-subclass", "params-a-str", "req-id-an-int", "params-an-array"],
)
def test_odd_params_and_request_ids_fall_back_to_defaults(mgr: TieringManager, request_: RequestContext) -> None:
    """Regression (review, 2026-12-02): a selector of a str subclass ran the client's methods,
    params given as a str raised AttributeError, and a non-str req_id raised once a malformed
    setting was logged: all from lookup, on the scheduler thread."""
    key = b"q" * 32
    assert mgr.lookup(key, request_) is not None
    assert mgr.lookup_prefix([key], request_).ready == 0


def test_a_request_that_is_not_a_request_context_is_named(mgr: TieringManager) -> None:
    with pytest.raises(TypeError, match="request must be a RequestContext"):
        mgr.lookup(b"q" * 32, "r4")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request must be a RequestContext"):
        mgr.request_control("r4")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value",
    [["cpu"] * 65, ["memory"] * 200_000, ["cpu", " " * 10_000 + "cpu"]],
    ids=["65 selectors", "200k valid selectors", "a 10k-character selector"],
)
def test_a_selector_list_longer_than_any_engine_needs_is_refused_unread(mgr: TieringManager, value: Any) -> None:
    """Regression (review, 2026-12-03): every item of an uncapped selector list was parsed on the
    scheduler thread (~50 ms per MB a client sent), and a list of valid names was accepted."""
    control = mgr.request_control(RequestContext("long", {LOAD_TIERS_KEY: value}))
    assert control.load_from is None  # the default: refused, not applied
    assert mgr.stats().manager.request_control_problems == {f"{LOAD_TIERS_KEY}:not_selectors": 1}
    ok = mgr.request_control(RequestContext("ok", {LOAD_TIERS_KEY: ["cpu"] * 64}))
    assert ok.load_from == frozenset({0})


@pytest.mark.parametrize("key", CONTROL_KEYS)
@pytest.mark.parametrize(
    "value",
    [[10**5000], {"n": 10**5000}, {10**5000: "k"}, [[1, 10**5000]]],
    ids=["in a list", "a dict value", "a dict key", "nested"],
)
def test_a_huge_integer_inside_a_value_is_described_not_raised(mgr: TieringManager, key: str, value: Any) -> None:
    """Regression (audit, 2026-12-05): an integer past Python's 4300-digit limit inside a list or
    dict made the message's bounded repr raise ValueError, out of lookup on the scheduler thread."""
    from kvtier.request_control import describe_value

    assert "<int of 16610 bits>" in describe_value(value)
    ctx = RequestContext("huge-inside", {key: value})
    assert mgr.lookup(b"q" * 32, ctx) is not None
    assert sum(mgr.stats().manager.request_control_problems.values()) == 1
