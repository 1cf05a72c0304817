"""TieringManager.shutdown: every case of DESIGN.md section 5 "Shutdown", one test each."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

import tier_doubles
from kvtier import Namespace, RequestContext, TieringManager, TierShutdownError
from kvtier.errors import ConfigError
from kvtier.region import region_path
from kvtier.tiers.registry import register_tier
from tier_doubles import ScriptedTier

pytestmark = pytest.mark.usefixtures("shm_leak_check")
register_tier("scripted", "tier_doubles:ScriptedTier")


@pytest.fixture(autouse=True)
def _clear_calls() -> Iterator[None]:
    tier_doubles.CALLS.clear()
    yield
    tier_doubles.CALLS.clear()


def _manager(namespace: Namespace, *tier_options: dict[str, Any]) -> TieringManager:
    specs = [{"type": "scripted", "name": f"t{i}", **opts} for i, opts in enumerate(tier_options, start=1)]
    return TieringManager.create(namespace=namespace, num_cpu_blocks=8, tiers=specs)


def _store_block(mgr: TieringManager, key: bytes, fill: int) -> None:
    req = RequestContext("r")
    result = mgr.prepare_store([key], req)
    assert result is not None
    rows = mgr.rows
    rows[int(result.slots[0]), : mgr.block_bytes] = fill
    del rows
    mgr.complete_store(result.keys_to_store, req)


def _tiers(mgr: TieringManager) -> list[ScriptedTier]:
    return [t for t in mgr.tiers if isinstance(t, ScriptedTier)]


def test_all_tiers_succeed_releases_primary(namespace: Namespace) -> None:
    mgr = _manager(namespace, {}, {}, {})
    path = region_path(mgr.region.name)
    _store_block(mgr, b"k" * 32, 5)
    mgr.shutdown()
    assert [t.shutdown_calls for t in _tiers(mgr)] == [1, 1, 1]
    assert mgr.region.closed and mgr.is_shut_down
    assert not path.exists()


def test_first_of_three_fails(namespace: Namespace, caplog: pytest.LogCaptureFixture) -> None:
    boom = RuntimeError("disk thread stuck")
    mgr = _manager(namespace, {"shutdown_error": boom}, {}, {})
    _store_block(mgr, b"a" * 32, 7)
    with caplog.at_level(logging.ERROR, logger="kvtier.manager"), pytest.raises(TierShutdownError) as info:
        mgr.shutdown()
    first, second, third = _tiers(mgr)
    assert (first.shutdown_calls, second.shutdown_calls, third.shutdown_calls) == (1, 1, 1)
    records = [r for r in caplog.records if "Failed to shut down" in r.getMessage()]
    assert len(records) == 1
    message = records[0].getMessage()
    assert "#1" in message and "type=scripted" in message and "class=ScriptedTier" in message
    # The failure is logged as text, traceback included; the record keeps no exception object (its
    # frames would keep views of the CPU rows alive in a handler that keeps records).
    assert "RuntimeError: disk thread stuck" in message and "Traceback" in message
    assert records[0].exc_info is None
    # the error raised is that tier's: chained as the cause and carried as the only failure
    assert info.value.__cause__ is boom
    assert info.value.errors == [boom]
    assert info.value.failures[0].index == 1 and info.value.failures[0].class_name == "ScriptedTier"
    # the primary is not shut down and its bytes are still readable
    assert not mgr.region.closed and not mgr.is_shut_down
    rows = mgr.rows
    slot = mgr.primary.slot_of(b"a" * 32)
    assert slot is not None and int(rows[slot, 0]) == 7 and int(rows[slot, mgr.block_bytes - 1]) == 7
    del rows
    first.shutdown_error = None
    mgr.shutdown()
    assert mgr.region.closed


def test_two_fail_last_is_raised_and_both_reachable(namespace: Namespace, caplog: pytest.LogCaptureFixture) -> None:
    e1, e3 = OSError("first"), ValueError("third")
    mgr = _manager(namespace, {"shutdown_error": e1}, {}, {"shutdown_error": e3})
    with caplog.at_level(logging.ERROR, logger="kvtier.manager"), pytest.raises(TierShutdownError) as info:
        mgr.shutdown()
    logged = [r.getMessage() for r in caplog.records if "Failed to shut down" in r.getMessage()]
    assert len(logged) == 2
    assert "#1" in logged[0] and "#3" in logged[1]
    assert info.value.__cause__ is e3, "the last failure must be the one chained"
    assert info.value.errors == [e1, e3]
    assert [f.index for f in info.value.failures] == [1, 3]
    assert not mgr.region.closed
    for t in _tiers(mgr):
        t.shutdown_error = None
    mgr.shutdown()


def test_retry_shuts_down_only_failed_tiers_then_primary(namespace: Namespace) -> None:
    mgr = _manager(namespace, {}, {"shutdown_error": RuntimeError("x")}, {})
    with pytest.raises(TierShutdownError):
        mgr.shutdown()
    t1, t2, t3 = _tiers(mgr)
    with pytest.raises(TierShutdownError):
        mgr.shutdown()  # still failing: only tier 2 is retried
    assert (t1.shutdown_calls, t2.shutdown_calls, t3.shutdown_calls) == (1, 2, 1)
    assert not mgr.region.closed
    t2.shutdown_error = None
    mgr.shutdown()
    assert (t1.shutdown_calls, t2.shutdown_calls, t3.shutdown_calls) == (1, 3, 1)
    assert mgr.region.closed and mgr.is_shut_down


def test_completed_shutdown_is_a_noop(namespace: Namespace) -> None:
    mgr = _manager(namespace, {}, {})
    mgr.shutdown()
    mgr.shutdown()
    assert [t.shutdown_calls for t in _tiers(mgr)] == [1, 1]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_interrupt_inside_a_tier_propagates_and_never_releases_primary(
    namespace: Namespace, interrupt: type[BaseException]
) -> None:
    mgr = _manager(namespace, {}, {"shutdown_error": interrupt()}, {})
    _store_block(mgr, b"i" * 32, 3)
    with pytest.raises(interrupt):
        mgr.shutdown()
    t1, t2, t3 = _tiers(mgr)
    assert not mgr.region.closed and not mgr.is_shut_down
    rows = mgr.rows
    slot = mgr.primary.slot_of(b"i" * 32)
    assert slot is not None and int(rows[slot, 0]) == 3
    del rows
    assert t3.shutdown_calls == 0, "an interrupt stops the shutdown where it happened"
    t2.shutdown_error = None
    mgr.shutdown()
    assert (t1.shutdown_calls, t2.shutdown_calls, t3.shutdown_calls) == (1, 2, 1)
    assert mgr.region.closed


def test_construction_failure_cleans_up_in_reverse_and_raises_original(namespace: Namespace) -> None:
    original = ConfigError("tier 3 cannot reach its bucket")
    specs = [
        {"type": "scripted", "name": "t1"},
        {"type": "scripted", "name": "t2"},
        {"type": "scripted", "name": "t3", "construct_error": original},
    ]
    with pytest.raises(ConfigError) as info:
        TieringManager.create(namespace=namespace, num_cpu_blocks=4, tiers=specs, region_name="ctor-fail")
    assert info.value is original
    assert tier_doubles.CALLS == [("t2", "shutdown"), ("t1", "shutdown")]
    assert not region_path("ctor-fail").exists()


def test_construction_failure_of_unknown_tier_type(namespace: Namespace) -> None:
    with pytest.raises(ConfigError, match="unknown tier type 'nope'"):
        TieringManager.create(namespace=namespace, num_cpu_blocks=4, tiers=[{"type": "nope"}])


def test_shutdown_error_message_names_every_failure(namespace: Namespace) -> None:
    mgr = _manager(namespace, {"shutdown_error": RuntimeError("alpha")}, {"shutdown_error": RuntimeError("beta")})
    with pytest.raises(TierShutdownError) as info:
        mgr.shutdown()
    text = str(info.value)
    assert "alpha" in text and "beta" in text and "tier #1" in text and "tier #2" in text
    for t in _tiers(mgr):
        t.shutdown_error = None
    mgr.shutdown()


@pytest.mark.parametrize("deadline", [None, 5.0])
def test_a_cancelled_error_from_one_tier_is_its_failure_and_the_next_tier_still_shuts_down(
    namespace: Namespace, caplog: pytest.LogCaptureFixture, deadline: float | None
) -> None:
    """Regression (review, 2026-12-02): asyncio.CancelledError (a BaseException, not an Exception)
    from tier #1's shutdown() stopped the shutdown: tier #2 was never attempted, nothing was
    logged, and the caller got the raw CancelledError instead of TierShutdownError."""
    import asyncio

    specs = [{"type": "scripted", "name": "t1", "shutdown_error": asyncio.CancelledError()}, {"type": "scripted",
                                                                                               "name": "t2"}]
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=8, tiers=specs, shutdown_timeout=deadline)
    _store_block(mgr, b"c" * 32, 3)
    with caplog.at_level(logging.ERROR), pytest.raises(TierShutdownError) as caught:
        mgr.shutdown()
    first, second = _tiers(mgr)
    assert second.shutdown_calls == 1, "the next tier must still be shut down"
    assert [f.index for f in caught.value.failures] == [1]
    assert isinstance(caught.value.failures[0].error, asyncio.CancelledError)
    assert "#1" in caplog.text and "scripted" in caplog.text and "ScriptedTier" in caplog.text
    assert not mgr.region.closed, "a failed tier may still use the rows: the region stays mapped"
    first.shutdown_error = None
    mgr.shutdown()
    assert mgr.is_shut_down and first.shutdown_calls == 2 and second.shutdown_calls == 1


def test_a_failed_create_shuts_built_tiers_down_within_shutdown_timeout(namespace: Namespace) -> None:
    """Regression (review, 2026-12-02): when a later tier's constructor failed, create() shut the
    tiers already built down with no deadline: a tier whose shutdown() hangs hung create()."""
    import threading
    import time

    gate = threading.Event()
    specs = [{"type": "scripted", "name": "t1", "shutdown_gate": gate},
             {"type": "scripted", "name": "t2", "construct_error": RuntimeError("tier #2 cannot start")}]
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="cannot start"):
            TieringManager.create(namespace=namespace, num_cpu_blocks=8, tiers=specs, shutdown_timeout=0.5)
        assert time.monotonic() - started < 5.0, "create() waited for a hanging tier past shutdown_timeout"
    finally:
        gate.set()  # let the abandoned shutdown() finish


@pytest.mark.parametrize("deadline", [120.0, None])
def test_two_threads_shutting_down_at_once_shut_each_tier_down_once(namespace: Namespace, deadline: Any) -> None:
    """Review r1: shutdown() from two threads at once (an engine's shutdown path and a signal
    handler) raised a stray KeyError or ValueError and called a tier's shutdown() twice. The second
    call now waits for the first, then finds the manager shut down."""
    import threading

    gate = threading.Event()
    specs = [{"type": "scripted", "name": f"t{i}", "shutdown_gate": gate} for i in (1, 2)]
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=8, tiers=specs, shutdown_timeout=deadline)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            mgr.shutdown()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    threading.Timer(0.3, gate.set).start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert [t.shutdown_calls for t in _tiers(mgr)] == [1, 1]
    assert mgr.is_shut_down and mgr.region.closed


@pytest.mark.parametrize("timeout", [0, 0.0, -1])
def test_a_shutdown_deadline_of_zero_is_refused_like_the_setting(namespace: Namespace, timeout: float) -> None:
    """Review r1: create(shutdown_timeout=0) is refused (every tier would be abandoned at once),
    but shutdown(timeout=0) was taken and reported healthy tiers as failed (TierShutdownTimeout)."""
    mgr = _manager(namespace, {}, {})
    with pytest.raises(ConfigError, match=r"shutdown\(timeout=...\)"):
        mgr.shutdown(timeout=timeout)
    assert not mgr.is_shut_down and [t.shutdown_calls for t in _tiers(mgr)] == [0, 0]
    mgr.shutdown()
    assert mgr.is_shut_down


@pytest.mark.timeout(60)
def test_a_shutdown_nested_in_a_running_one_on_its_thread_returns_at_once(namespace: Namespace) -> None:
    """Review r2: a signal handler calling shutdown() while the main thread was inside shutdown()
    waited for a lock its own thread held: the process hung for good. The nested call returns at
    once; the running one finishes."""
    import os
    import signal
    import threading
    import time

    gate = threading.Event()
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=8,
                                tiers=[{"type": "scripted", "name": "t1", "shutdown_gate": gate}])  # fmt: skip
    nested: list[float] = []

    def on_term(*_: Any) -> None:
        started = time.monotonic()
        mgr.shutdown()
        nested.append(time.monotonic() - started)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        threading.Timer(2.0, gate.set).start()
        mgr.shutdown()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert nested and nested[0] < 1.0, nested
    assert mgr.is_shut_down and [t.shutdown_calls for t in _tiers(mgr)] == [1]


class _Unprintable(Exception):
    """An exception of a tier (a plugin or a client library) whose ``__str__`` is broken."""

    def __str__(self) -> str:
        raise ValueError("str() of this error fails")


class _NotText(Exception):
    def __str__(self) -> Any:
        return 42  # str() raises TypeError: __str__ returned non-string


@pytest.mark.parametrize("error", [_Unprintable(), _NotText()], ids=["str-raises", "str-not-a-str"])
@pytest.mark.parametrize("deadline", [None, 5.0])
def test_an_unprintable_error_from_one_tier_still_shuts_the_next_down_and_is_named(
    namespace: Namespace, caplog: pytest.LogCaptureFixture, error: Exception, deadline: float | None
) -> None:
    """Regression (review, 2026-12-05): tier #1's shutdown() raised an exception whose str() fails;
    logging it raised that ValueError out of shutdown(): tier #2 was never tried, no
    TierShutdownError was raised, and every retry stopped at the same place."""
    specs = [{"type": "scripted", "name": "t1", "shutdown_error": error}, {"type": "scripted", "name": "t2"}]
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=8, tiers=specs, shutdown_timeout=deadline)
    _store_block(mgr, b"u" * 32, 9)
    with caplog.at_level(logging.ERROR), pytest.raises(TierShutdownError) as caught:
        mgr.shutdown()
    first, second = _tiers(mgr)
    assert second.shutdown_calls == 1, "the next tier must still be shut down"
    assert caught.value.errors == [error]
    name = type(error).__name__
    assert f"tier #1 (type=scripted, class=ScriptedTier): {name}: <unprintable {name}>" in str(caught.value)
    logged = [r.getMessage() for r in caplog.records if "Failed to shut down" in r.getMessage()]
    assert len(logged) == 1 and "#1" in logged[0] and f"{name}: <unprintable {name}>" in logged[0]
    assert not mgr.region.closed, "a failed tier may still use the rows: the region stays mapped"
    first.shutdown_error = None
    mgr.shutdown()
    assert mgr.is_shut_down and first.shutdown_calls == 2 and second.shutdown_calls == 1


def test_a_tier_that_drops_its_context_in_shutdown_does_not_stop_the_others(
    namespace: Namespace, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (review, 2026-12-06): a tier whose shutdown() drops its own ``context`` (a way to
    drop its view of the rows, as its contract asks) made the manager's release of that context
    raise AttributeError: the tiers after it were never shut down, their failures never logged."""
    boom = RuntimeError("tier 2 stuck")
    mgr = _manager(namespace, {"drop_context": True}, {"shutdown_error": boom}, {})
    path = region_path(mgr.region.name)
    _store_block(mgr, b"d" * 32, 3)
    with caplog.at_level(logging.ERROR, logger="kvtier.manager"), pytest.raises(TierShutdownError) as info:
        mgr.shutdown()
    assert [t.shutdown_calls for t in _tiers(mgr)] == [1, 1, 1]
    assert [f.index for f in info.value.failures] == [2] and info.value.__cause__ is boom
    assert any("#2" in r.getMessage() and "tier 2 stuck" in r.getMessage() for r in caplog.records)
    assert not mgr.region.closed  # a tier failed: the CPU tier stays mapped
    _tiers(mgr)[1].shutdown_error = None
    mgr.shutdown()  # the retry asks only the failed tier, then releases the CPU tier
    assert [t.shutdown_calls for t in _tiers(mgr)] == [1, 2, 1]
    assert mgr.region.closed and not path.exists()


def test_stats_keep_the_admission_rule_of_a_tier_that_dropped_its_context(namespace: Namespace) -> None:
    """Regression (review, 2026-12-06): the snapshot read a tier's admission rule through the
    tier's own context: after a shutdown that dropped it, a learned rule showed as 'all'."""
    mgr = _manager(namespace, {"drop_context": True, "admission": "learned"}, {"shutdown_error": RuntimeError("x")})
    assert [t.admission.rule for t in mgr.stats().tiers[1:]] == ["learned", "all"]
    with pytest.raises(TierShutdownError):
        mgr.shutdown()
    assert [t.admission.rule for t in mgr.stats().tiers[1:]] == ["learned", "all"]
    _tiers(mgr)[1].shutdown_error = None
    mgr.shutdown()


def test_a_failed_create_shuts_down_every_built_tier_when_one_drops_its_context(namespace: Namespace) -> None:
    """Regression (review, 2026-12-06): the cleanup after a failed create() released each tier's
    context through the tier; one that dropped it in shutdown() stopped the cleanup with
    AttributeError (the original error only in __context__, tier #1 never shut down)."""
    original = ConfigError("tier 3 cannot reach its bucket")
    specs = [
        {"type": "scripted", "name": "t1"},
        {"type": "scripted", "name": "t2", "drop_context": True},
        {"type": "scripted", "name": "t3", "construct_error": original},
    ]
    with pytest.raises(ConfigError) as info:
        TieringManager.create(namespace=namespace, num_cpu_blocks=4, tiers=specs, region_name="ctor-drops")
    assert info.value is original
    assert tier_doubles.CALLS == [("t2", "shutdown"), ("t1", "shutdown")]
    assert not region_path("ctor-drops").exists()
