"""Application hints in the per-request channel: parsed and bounded like the other keys.

``kvtier_session``, ``kvtier_session_end`` and ``kvtier_expected_return_s`` are client
input: a malformed value falls back to its default and is counted, never kept.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import Namespace, RequestContext, TieringManager, prefix_keys
from kvtier.request_control import (
    EXPECTED_RETURN_KEY,
    SESSION_END_KEY,
    SESSION_KEY,
    TierDescriptor,
    parse_control_problems,
)
from kvtier.types import DEFAULT_CONTROL, RequestHints

TIERS = [TierDescriptor(0, "0:primary", "primary", "local")]


class SneakyStr(str):
    def isprintable(self) -> bool:
        raise RuntimeError("a client's method ran")


class SneakyFloat(float):
    def __float__(self) -> float:
        raise RuntimeError("a client's method ran")


def hints_of(params: dict[str, Any]) -> tuple[RequestHints | None, list[tuple[str, str]]]:
    control, problems = parse_control_problems(params, TIERS)
    return control.hints, [(p.key, p.kind) for p in problems]


def test_well_formed_hints_are_parsed() -> None:
    hints, problems = hints_of({SESSION_KEY: "conv-42", SESSION_END_KEY: True, EXPECTED_RETURN_KEY: 30})
    assert problems == []
    assert hints == RequestHints("conv-42", True, 30.0)
    assert hints_of({EXPECTED_RETURN_KEY: 0})[0] == RequestHints(None, False, 0.0)
    assert hints_of({EXPECTED_RETURN_KEY: 86400.0})[0] == RequestHints(None, False, 86400.0)
    assert hints_of({SESSION_KEY: "x" * 128})[0] == RequestHints("x" * 128)
    assert hints_of({SESSION_END_KEY: False}) == (None, [])  # nothing said: no hints


@pytest.mark.parametrize(
    ("key", "value", "kind"),
    [
        (SESSION_KEY, "", "not_session_id"),
        (SESSION_KEY, "x" * 129, "not_session_id"),
        (SESSION_KEY, "a\nb", "not_session_id"),
        (SESSION_KEY, "\ud800", "not_session_id"),
        (SESSION_KEY, 42, "not_session_id"),
        (SESSION_KEY, ["conv"], "not_session_id"),
        (SESSION_KEY, "y" * 1_000_000, "not_session_id"),
        (SESSION_END_KEY, "true", "not_boolean"),
        (SESSION_END_KEY, 1, "not_boolean"),
        (EXPECTED_RETURN_KEY, -1, "not_seconds"),
        (EXPECTED_RETURN_KEY, 86400.5, "not_seconds"),
        (EXPECTED_RETURN_KEY, math.nan, "not_seconds"),
        (EXPECTED_RETURN_KEY, math.inf, "not_seconds"),
        (EXPECTED_RETURN_KEY, -math.inf, "not_seconds"),
        (EXPECTED_RETURN_KEY, 10**400, "not_seconds"),
        (EXPECTED_RETURN_KEY, True, "not_seconds"),
        (EXPECTED_RETURN_KEY, "30", "not_seconds"),
        (EXPECTED_RETURN_KEY, [30], "not_seconds"),
        (EXPECTED_RETURN_KEY, SneakyFloat(3.0), "not_seconds"),
    ],
)
def test_a_malformed_hint_falls_back_to_its_default_and_is_counted(key: str, value: Any, kind: str) -> None:
    good = {SESSION_KEY: "s", SESSION_END_KEY: True, EXPECTED_RETURN_KEY: 5.0}
    hints, problems = hints_of({**good, key: value})
    assert problems == [(key, kind)]
    defaults = {SESSION_KEY: None, SESSION_END_KEY: False, EXPECTED_RETURN_KEY: None}
    expected = {**good, key: defaults[key]}
    assert hints == RequestHints(expected[SESSION_KEY], expected[SESSION_END_KEY], expected[EXPECTED_RETURN_KEY])


def test_a_str_subclass_is_kept_as_a_plain_str_and_its_methods_never_run() -> None:
    # Regression: the check called the subclass's isprintable (the client's code).
    value = SneakyStr("conv")
    try:
        hints, problems = hints_of({SESSION_KEY: value})
    except RuntimeError:
        pytest.fail("the client's isprintable ran")
    assert hints is not None and type(hints.session) is str and problems == []


@pytest.fixture
def mgr(namespace: Namespace, private_shm: Path) -> Iterator[TieringManager]:
    manager = TieringManager.create(namespace=namespace, num_cpu_blocks=16, shm_dir=private_shm)
    yield manager
    manager.shutdown()


def test_the_manager_parses_hints_once_and_counts_bad_ones(mgr: TieringManager) -> None:
    good = RequestContext("a", {SESSION_KEY: "conv", EXPECTED_RETURN_KEY: 12})
    assert mgr.request_control(good).hints == RequestHints("conv", False, 12.0)
    bad = RequestContext("b", {SESSION_KEY: "z" * 10_000, EXPECTED_RETURN_KEY: -3})
    assert mgr.request_control(bad) is DEFAULT_CONTROL
    counts = mgr.stats().manager.request_control_problems
    assert counts == {f"{SESSION_KEY}:not_session_id": 1, f"{EXPECTED_RETURN_KEY}:not_seconds": 1}


def test_a_hinted_request_is_stored_loaded_and_finished_like_any_and_the_policy_hears_it(
    mgr: TieringManager,
) -> None:
    keys = prefix_keys(np.arange(48), 4)
    turns = [
        (keys[:8], {SESSION_KEY: "c", EXPECTED_RETURN_KEY: 1.0}),
        (keys[:12], {SESSION_KEY: "c", SESSION_END_KEY: True}),
    ]
    for n, (request_keys, params) in enumerate(turns):
        req = RequestContext(f"r{n}", params)
        mgr.on_new_request(req)
        hits = 0
        while hits < len(request_keys) and mgr.lookup(request_keys[hits], req).name == "HIT":
            hits += 1
        assert hits == (8 if n else 0)
        if hits:
            mgr.prepare_load(request_keys[:hits], req)
            mgr.complete_load(request_keys[:hits], req)
        result = mgr.prepare_store(request_keys[hits:], req)
        assert result is not None and len(result.keys_to_store) == len(request_keys) - hits
        mgr.complete_store(result.keys_to_store, req, True)
        mgr.on_request_finished(req)
        mgr.on_schedule_end()
    stats = mgr.stats().cpu.policy
    assert stats is not None and stats.values["hinted_ended"] == 1


@pytest.mark.parametrize("hint", [{SESSION_END_KEY: True}, {SESSION_KEY: "y", SESSION_END_KEY: True}],
                         ids=["ended", "session-ended"])
@pytest.mark.parametrize("own_tail", [False, True], ids=["stores-nothing", "stores-its-own-tail"])
def test_an_ended_request_that_stored_only_blocks_held_already_leaves_them_to_their_writer(
    namespace: Namespace, private_shm: Path, hint: dict[str, Any], own_tail: bool
) -> None:
    """Regression (audit, 2026-12-05): a request whose store found every block held already (a
    running request X wrote them) took X's tail as its own: its end settled X's request and its
    session-end hint had X's blocks, a prefix another conversation still extends, evicted before
    any other. With a block of its own after them, that block (its own) is the one hinted."""
    manager = TieringManager.create(namespace=namespace, num_cpu_blocks=8, shm_dir=private_shm, policy="return-time")
    try:
        older, shared, extra, later = (prefix_keys(np.arange(base, base + 16), 4) for base in (1000, 2000, 3000, 4000))

        def store(req: RequestContext, keys: list[bytes]) -> list[bytes]:
            result = manager.prepare_store(keys, req)
            assert result is not None
            manager.complete_store(result.keys_to_store, req)
            return result.evicted_keys

        done = RequestContext("old", {SESSION_KEY: "old"})
        store(done, older)
        manager.on_request_finished(done)
        manager.on_schedule_end()
        running = RequestContext("x", {SESSION_KEY: "x"})  # stores its prefix, and goes on
        store(running, shared[:2])
        manager.on_schedule_end()
        ended = RequestContext("y", hint)
        assert store(ended, shared[:2] + (extra[:1] if own_tail else [])) == []
        manager.on_request_finished(ended)
        manager.on_schedule_end()
        evicted = store(RequestContext("z"), later[:4 if own_tail else 3])
        assert not set(evicted) & set(shared[:2]), "the running request's prefix went first"
        if own_tail:
            assert extra[0] in evicted, "the ended request's own block went last"
    finally:
        manager.shutdown()
