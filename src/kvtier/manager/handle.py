"""One secondary tier as the manager sees it: a :class:`TierHandle` (the manager keeps one per tier).

A handle holds all the manager keeps of one tier: its index (1-based, as in
labels, logs and errors), its context (the rows' holder the tier was built with),
descriptor, telemetry, cascade admission, liveness, wait state
(:mod:`kvtier.manager.waits`: RETRY clocks, blocks it may not promise, jobs past
the deadline) and a blocking call still running past its deadline. Every call of
a tier is guarded here or in :mod:`kvtier.manager.tierset`: one that raises, or
answers with a value of the wrong type, is counted (``call_error``), logged once
per call, and answered with its safe default, so a tier never crashes the
engine's scheduler. Scheduler thread only, except :meth:`TierHandle.shutdown`
and :meth:`TierHandle.drain` (the thread that shuts down or resets the manager).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from kvtier.errors import TierDrainTimeout, TierError, TierShutdownTimeout
from kvtier.failures import log_failure
from kvtier.manager.admission import CascadeAdmission
from kvtier.manager.blocking import BlockingCalls
from kvtier.manager.waits import BlockWaits
from kvtier.request_control import TierDescriptor, tier_locality
from kvtier.telemetry import ManagerCounters, TierTelemetry
from kvtier.tiers.base import SecondaryTier, TierContext, TransferJob
from kvtier.types import tier_label
from kvtier.validation import shown_value

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

DRAIN_GRACE = 1.0
"""Seconds past its timeout a tier's ``drain(timeout)`` is waited for (one honouring it raises in time)."""


class TierHandle:
    """One secondary tier and the manager's state of it (see the module docstring)."""

    __slots__ = ("_calls", "_counters", "_logged", "admission", "context", "descriptor", "has_step_end", "index",
                 "last_counters", "live", "overdue", "retry_since", "telemetry", "tier", "waits")  # fmt: skip

    def __init__(self, index: int, tier: SecondaryTier, admission: CascadeAdmission | None,
                 counters: ManagerCounters, waits: BlockWaits) -> None:
        self.index = index
        self.tier = tier
        context = getattr(tier, "context", None)
        self.context = context if isinstance(context, TierContext) else None
        """The tier's context, kept here: a tier may drop its own in ``shutdown()`` (its duty is to
        drop every view of the rows), and the manager still releases the context's view after it."""
        self.descriptor = TierDescriptor(index, tier_label(index, tier.tier_type), tier.tier_type,
                                         tier_locality(tier.medium, getattr(tier, "locality", None)))
        self.telemetry = TierTelemetry()
        self.admission, self.live = admission, True
        self.waits = waits.for_tier(self.telemetry)
        self.retry_since = self.waits.retry_since  # the same dict: the lookup path tests it without a hop
        self.overdue = 0
        """Jobs of this tier in flight past the wait deadline: while any, no lookup asks it and
        no cascade goes to it (the tier is not answering; its rows stay as they are)."""
        base = SecondaryTier.on_schedule_end  # the base class's does nothing: a call per step saved
        self.has_step_end = getattr(getattr(tier, "on_schedule_end", None), "__func__", None) is not base
        self._counters, self._logged = counters, set[str]()
        self.last_counters: tuple[dict[str, Any], dict[str, float], dict[str, str]] = ({}, {}, {})
        """The tier's counters, extra metrics and their kinds as last read without error: a snapshot
        whose read fails reuses them (:meth:`~kvtier.manager.snapshot.TierReading.of`), so one failed
        read never drops the tier's counters to 0 (nor makes an exporter of increments send them again)."""
        self._calls = BlockingCalls(tier, f"tier{index}")

    def failed(self, call: str, exc: Exception) -> None:
        """The tier raised ``exc`` from ``call()``: count it, and log it the first time (as text,
        with its traceback: the record keeps no frame, so no view of the CPU rows)."""
        self._counters.tier_call_errors += 1
        self.telemetry.fail("call_error")
        if call not in self._logged:
            self._logged.add(call)
            what = (f"secondary tier #{self.index} (type={self.tier.tier_type}, class={type(self.tier).__qualname__}) "
                    f"raised from {call}(); treated as its safe default (further errors of this call are only counted)")
            log_failure(logger, logging.ERROR, what, exc, with_traceback=True)

    def wrong_answer(self, call: str, answer: object, expected: str) -> None:
        """The tier's ``call()`` returned ``answer``, not ``expected``: a broken tier, counted and
        logged as :meth:`failed` (the caller takes the call's safe default)."""
        self.failed(call, TypeError(f"{call}() answered {shown_value(answer)}, not {expected}"))

    def call(self, name: str, *args: Any, default: Any = None) -> Any:
        """The tier's method ``name`` called with ``args``, or ``default`` if it raised (see :meth:`failed`)."""
        try:
            return getattr(self.tier, name)(*args)
        except Exception as exc:
            self.failed(name, exc)
            return default

    def guard(self, call: str, fn: Callable[[], _T], default: _T) -> _T:
        """``fn()`` (which reads the tier), or ``default`` if it raised, counted as ``call()`` failing."""
        try:
            return fn()
        except Exception as exc:
            self.failed(call, exc)
            return default

    def submit(self, job: TransferJob) -> bool:
        """Hand ``job`` to the tier; False if it refused (logged, counted as ``submit_error``) or is shut down."""
        try:
            if self.live:  # (not after a shutdown a signal handler ran inside the manager's call)
                (self.tier.submit_load if job.is_promotion else self.tier.submit_store)(job)
        except Exception as exc:
            if not self.live:  # shut down inside the tier's call: a refusal, not a failure
                return False
            kind = "load" if job.is_promotion else "store"
            log_failure(logger, logging.ERROR, f"secondary tier #{self.index} failed to accept {kind} job "
                        f"{job.job_id}", exc, with_traceback=True)  # fmt: skip
            self._counters.submit_errors += 1
            self.telemetry.fail("submit_error")
            return False
        return self.live

    def drain(self, timeout: float | None) -> None:
        """The tier's ``drain(timeout)``, waited for ``timeout`` + :data:`DRAIN_GRACE` s at most (twice a shorter
        timeout): raises its TierError, a TierError naming the tier for another error, or TierDrainTimeout."""
        still = " (still running the drain() of an earlier reset)" if self._calls.running("drain") else ""
        wait = None if timeout is None else timeout + min(timeout, DRAIN_GRACE)
        done, error = self._calls.run("drain", wait, timeout)
        if not done:
            raise TierDrainTimeout(
                f"secondary tier #{self.index} (type={self.tier.tier_type}) did not return from drain() within "
                f"{timeout:.3g}s{still}; nothing was reset. Call reset_cache() again to wait for it"
            )
        if error is not None:  # named, as a shutdown failure is
            what = f"secondary tier #{self.index} (type={self.tier.tier_type}) failed to drain: {error!r}"
            raise error if isinstance(error, TierError) else TierError(what) from error

    def shutdown(self, share: float | None) -> BaseException | None:
        """Run (or keep waiting for) the tier's ``shutdown()`` for at most ``share`` seconds (None:
        no deadline); its error, or None on success. KeyboardInterrupt/SystemExit propagate."""
        still = " (still running the shutdown() of an earlier attempt)" if self._calls.running("shutdown") else ""
        done, error = self._calls.run("shutdown", share)
        if done:
            return error
        return TierShutdownTimeout(
            f"secondary tier #{self.index} (type={self.tier.tier_type}) did not finish shutdown() within its "
            f"{share:.3g}s share of the deadline{still}; abandoned while still running, so the CPU "
            "tier stays mapped. Call shutdown() again to wait for it"
        )


__all__ = ["DRAIN_GRACE", "TierHandle"]
