"""TieringManager.shutdown(timeout=...): a hanging tier never hangs the shutdown (issue 9, item 6).

The seed rules of tests/test_manager_shutdown.py stand; these add the deadline: a tier
that overruns its share is abandoned, counted as failed (primary kept mapped), the next
tiers are still attempted, and a retry treats a tier still running its earlier shutdown
as not done.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from kvtier import Namespace, RequestContext, TieringManager, TierShutdownError, TierShutdownTimeout
from kvtier.config import build_manager, load_config
from kvtier.errors import ConfigError
from kvtier.tiers.registry import register_tier
from tier_doubles import ScriptedTier

pytestmark = pytest.mark.usefixtures("shm_leak_check")
register_tier("scripted", "tier_doubles:ScriptedTier")


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()  # never leave a tier thread hanging behind the test


def _manager(namespace: Namespace, *tier_options: dict[str, Any], **kwargs: Any) -> TieringManager:
    specs = [{"type": "scripted", "name": f"t{i}", **opts} for i, opts in enumerate(tier_options, start=1)]
    return TieringManager.create(namespace=namespace, num_cpu_blocks=8, tiers=specs, **kwargs)


def _tiers(mgr: TieringManager) -> list[ScriptedTier]:
    return [t for t in mgr.tiers if isinstance(t, ScriptedTier)]


def _store(mgr: TieringManager, key: bytes, fill: int) -> None:
    plan = mgr.prepare_store([key], RequestContext("r"))
    assert plan is not None
    rows = mgr.rows
    rows[int(plan.slots[0]), : mgr.block_bytes] = fill
    del rows
    mgr.complete_store(plan.keys_to_store, RequestContext("r"))


def test_a_hanging_tier_is_abandoned_and_the_others_still_shut_down(
    namespace: Namespace, gate: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = _manager(namespace, {}, {"shutdown_gate": gate}, {})
    _store(mgr, b"h" * 32, 9)
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="kvtier.manager"), pytest.raises(TierShutdownError) as info:
        mgr.shutdown(timeout=0.6)
    assert time.monotonic() - t0 < 5, "shutdown must not wait for the hung tier"
    t1, t2, t3 = _tiers(mgr)
    assert (t1.shutdown_calls, t2.shutdown_calls, t3.shutdown_calls) == (1, 1, 1), "tier 3 still attempted"
    (failure,) = info.value.failures
    assert failure.index == 2 and failure.class_name == "ScriptedTier"
    assert isinstance(failure.error, TierShutdownTimeout) and info.value.__cause__ is failure.error
    logged = [r.getMessage() for r in caplog.records if "Failed to shut down" in r.getMessage()]
    assert len(logged) == 1 and "#2" in logged[0] and "type=scripted" in logged[0] and "class=ScriptedTier" in logged[0]
    # the primary stays mapped and readable
    assert not mgr.region.closed and not mgr.is_shut_down
    slot = mgr.primary.slot_of(b"h" * 32)
    rows = mgr.rows
    assert slot is not None and int(rows[slot, 0]) == 9
    del rows

    # a retry while tier 2 still runs its first shutdown(): not done, and not called twice
    with pytest.raises(TierShutdownError) as again:
        mgr.shutdown(timeout=0.2)
    assert t2.shutdown_calls == 1 and (t1.shutdown_calls, t3.shutdown_calls) == (1, 1)
    assert "still running" in str(again.value.failures[0].error)
    assert not mgr.region.closed

    gate.set()  # the hung call finishes (successfully): the next retry completes with it
    mgr.shutdown(timeout=5)
    assert t2.shutdown_calls == 1
    assert mgr.region.closed and mgr.is_shut_down


def test_an_abandoned_shutdown_that_then_fails_is_called_again(namespace: Namespace, gate: threading.Event) -> None:
    mgr = _manager(namespace, {"shutdown_gate": gate, "shutdown_error": RuntimeError("stuck thread")})
    with pytest.raises(TierShutdownError):
        mgr.shutdown(timeout=0.2)
    (tier,) = _tiers(mgr)
    gate.set()
    with pytest.raises(TierShutdownError) as info:
        mgr.shutdown(timeout=5)  # collects the earlier call's outcome: it failed
    assert str(info.value.failures[0].error) == "stuck thread" and tier.shutdown_calls == 1
    tier.shutdown_error = None
    mgr.shutdown(timeout=5)  # now called again, and it succeeds
    assert tier.shutdown_calls == 2 and mgr.region.closed


def test_the_deadline_default_comes_from_the_configuration(namespace: Namespace, gate: threading.Event) -> None:
    config = load_config(None, cli={"shutdown_timeout": "0.3", "num_cpu_blocks": "4"}, env={})
    assert config.shutdown_timeout == 0.3
    mgr = build_manager(config, namespace=namespace, tiers=[{"type": "scripted", "shutdown_gate": gate}])
    assert mgr.shutdown_timeout == 0.3
    t0 = time.monotonic()
    with pytest.raises(TierShutdownError):
        mgr.shutdown()
    assert time.monotonic() - t0 < 5
    gate.set()
    mgr.shutdown()
    assert mgr.is_shut_down


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_inside_a_tier_under_a_deadline_still_stops_there(
    namespace: Namespace, interrupt: type[BaseException]
) -> None:
    mgr = _manager(namespace, {}, {"shutdown_error": interrupt()}, {})
    with pytest.raises(interrupt):
        mgr.shutdown(timeout=10)
    t1, t2, t3 = _tiers(mgr)
    assert (t1.shutdown_calls, t2.shutdown_calls, t3.shutdown_calls) == (1, 1, 0)
    assert not mgr.region.closed
    t2.shutdown_error = None
    mgr.shutdown(timeout=10)
    assert mgr.region.closed


class _RecordingTier(ScriptedTier):
    threads: ClassVar[list[str]] = []

    def shutdown(self) -> None:
        self.threads.append(threading.current_thread().name)
        super().shutdown()


register_tier("recording", "test_manager_shutdown_deadline:_RecordingTier")


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_without_a_deadline_tiers_shut_down_in_the_calling_thread(namespace: Namespace, timeout: float | None) -> None:
    _RecordingTier.threads.clear()
    mgr = TieringManager.create(
        namespace=namespace, num_cpu_blocks=4, tiers=[{"type": "recording"}], shutdown_timeout=timeout
    )
    mgr.shutdown()
    assert mgr.is_shut_down
    expected = threading.current_thread().name if timeout is None else "kvtier-shutdown-tier1"
    assert _RecordingTier.threads == [expected]


def test_a_negative_deadline_is_refused_and_leaks_nothing(namespace: Namespace) -> None:
    with pytest.raises(ConfigError, match="shutdown_timeout"):
        TieringManager.create(namespace=namespace, num_cpu_blocks=4, shutdown_timeout=-1)
