"""Cascade admission: whether a secondary tier takes a cascade (store) job now.

A cascade copies blocks that a device store just made ready in the CPU tier
down to a secondary tier. Each tier's :class:`~kvtier.manager.handle.TierHandle`
holds one admission object, or None, which means the tier takes every cascade
("admission: all"). Promotions (loads) never ask: reads are what the engine
waits for, so they are never refused.

The contract of an admission (:class:`CascadeAdmission`). The manager calls every
method from the scheduler thread; none may block, and each should cost about a
dictionary operation, because ``admit`` runs once per cascade job and tier:

* ``admit(keys, request, stores_in_flight)``: whether the job of ``keys`` (ready
  CPU blocks of ``request`` in prefix order; ``request`` is None for a store without
  one) goes to the tier now. ``stores_in_flight`` is the number of the tier's
  cascade jobs that were submitted and not yet reported. Answering False skips the
  job: its blocks stay in the CPU tier only, and the manager counts them in
  ``cascades_skipped``. ``keys`` must not be modified; the key objects may be kept.
* ``finished(result, seconds)``: the tier reported one of its cascade jobs.
  ``seconds`` runs from submit to report (the tier's own figure when it gave one).
  Jobs that were skipped are never reported.
* ``served(keys)``: a load of ``keys`` from the tier succeeded; ``touched(keys)``: the
  tier was touched with ``keys`` (the CPU tier served them). Cheap, like ``admit``.
* ``snapshot()``: the state shown in the tier's :class:`~kvtier.telemetry.TierSnapshot`
  (its ``backpressure`` field), or None.

Two admissions are built in. Backpressure (:mod:`kvtier.backpressure`, on by
default) skips cascades while the tier's store latency is high. A tier whose spec
says ``admission: learned`` (:class:`~kvtier.tiers.options.CascadeOptions`) gets a
:class:`LearnedAdmission` around it: the CPU tier's eviction policy predicts how
likely a store's blocks are to be read again within the tier's horizon
(:meth:`~kvtier.policies.base.EvictionPolicy.relative_reuse`), and a store whose
blocks are much less likely than the average stored block is not written: in a full
tier it would displace blocks worth more, and the write costs bandwidth and wear.
The last request of a conversation with an earlier store judged here, by its hints
(``kvtier_session`` and ``kvtier_session_end``, see :mod:`kvtier.request_control`), is
not written either, whatever the policy: its new blocks are the conversation's own.
A policy that predicts nothing (``lru``) makes it admit everything. A measured guard
(:mod:`kvtier.manager.admission_guard`) counts the hits the rule gains and loses against
writing every store and, while it loses, has every store written. What each tier
admitted and declined, and the guard's state, are in its snapshot (``admission``) and
the metrics.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from kvtier.backpressure import BackpressureSettings, StoreLatencyMonitor
from kvtier.keys import BlockKey, session_digest
from kvtier.manager.admission_guard import ADMITTED, DECLINED, ENDED, OVERRIDDEN, ReturnWatch
from kvtier.primary import PrimaryTier
from kvtier.telemetry import BackpressureSnapshot
from kvtier.tiers.base import JobResult, SecondaryTier
from kvtier.types import RequestContext, tier_label

logger = logging.getLogger(__name__)


class CascadeAdmission(Protocol):
    """Decides which cascade jobs one secondary tier takes; see the module docstring."""

    def admit(self, keys: Sequence[BlockKey], request: RequestContext | None, stores_in_flight: int) -> bool:
        """Whether the cascade of ``keys`` goes to the tier now (False: skipped and counted)."""

    def finished(self, result: JobResult, seconds: float) -> None:
        """The tier reported one cascade job, ``seconds`` after it was submitted."""

    def served(self, keys: Sequence[BlockKey]) -> None:
        """The tier served ``keys``: a load (promotion) of them from it succeeded."""

    def touched(self, keys: Sequence[BlockKey]) -> None:
        """The tier was touched with ``keys`` (the CPU tier served them: their use renews their stay)."""

    def snapshot(self) -> BackpressureSnapshot | None:
        """The state to show in the tier's snapshot, or None."""


class BackpressureAdmission:
    """Backpressure as an admission: skips cascades while the tier's store latency is high.

    It takes one latency sample from each finished cascade job that reached the
    medium: the job moved bytes, or it failed after the tier spent time on it. Jobs
    that were skipped because the tier already held their keys, or shed at once, do
    not say anything about the tier's latency.
    """

    __slots__ = ("monitor",)

    def __init__(self, monitor: StoreLatencyMonitor) -> None:
        self.monitor = monitor

    def admit(self, keys: Sequence[BlockKey], request: RequestContext | None, stores_in_flight: int) -> bool:
        return self.monitor.admit(len(keys), stores_in_flight)

    def finished(self, result: JobResult, seconds: float) -> None:
        if result.bytes_moved > 0 or (not result.success and result.seconds > 0):
            self.monitor.observe(seconds)

    def served(self, keys: Sequence[BlockKey]) -> None:
        pass

    def touched(self, keys: Sequence[BlockKey]) -> None:
        pass

    def snapshot(self) -> BackpressureSnapshot:
        return self.monitor.snapshot()


DECLINE_BELOW = 0.4
"""A store is not written to a ``learned`` tier when its blocks are predicted less than 0.4 times
as likely to be read again within the tier's horizon as the average stored block: in a full tier
each write displaces a block worth, on average, 2.5 times as much. (0.5 lost 4 % of the hits on
a generated bursty workload whose long one-off documents share a class with long chat turns;
0.25 declined nearly nothing anywhere.)"""


SESSIONS_SEEN = 32768
"""Conversations :class:`LearnedAdmission` remembers having seen a request of (a hash each, the
oldest forgotten first): one forgotten has its last request judged by the policy."""


UNKNOWN_TIER_BLOCKS = 1 << 20
"""The guard's horizon, in blocks, for a tier that cannot tell its capacity."""


DECIDED_REQUESTS = 4096
"""Requests whose first store's decision :class:`LearnedAdmission` remembers for their later
stores (more than an engine runs at once; the oldest is forgotten first)."""


class LearnedAdmission:
    """``admission: learned``: writes a store's blocks to the tier only if the CPU tier's policy
    predicts they are worth it (see the module docstring); ``inner`` (backpressure, or None)
    is asked first.

    The tier's horizon, in references, is its capacity in blocks (``tier_blocks``; a block
    written to a full tier stays for at least that many writes, each at least one reference),
    or the policy's own horizon when the tier's capacity is unknown (None). ``watch`` is the
    measured guard (:mod:`kvtier.manager.admission_guard`): while it is fallen back the
    policy's declines are overridden (written).
    """

    __slots__ = ("_decided", "_horizon", "_policy", "_sessions", "_slot_of", "declined", "inner", "overridden",
                 "watch")

    def __init__(self, primary: PrimaryTier, tier_blocks: int | None, inner: CascadeAdmission | None) -> None:
        self.inner = inner
        self._policy = primary.policy
        self._slot_of = primary.slot_of
        self._horizon = tier_blocks if tier_blocks is not None else 1 << 62  # the policy caps it
        # The decision of each recent request's first store, which its later stores follow: a
        # request stored in pieces is one request (a piece declined after pieces admitted would
        # leave its successors useless in the tier, prefix hits being what counts).
        self._decided: OrderedDict[str, int] = OrderedDict()  # ADMITTED, DECLINED, OVERRIDDEN or ENDED
        self._sessions: OrderedDict[int, None] = OrderedDict()
        """Conversations (a 64-bit hash of their id) with a store judged here by a request that did not end them."""
        self.declined = 0
        """Blocks this admission declined (backpressure's are not counted here)."""
        self.overridden = 0
        """Blocks the policy would have declined, written because the guard had fallen back."""
        self.watch = ReturnWatch(tier_blocks if tier_blocks is not None else UNKNOWN_TIER_BLOCKS)

    def admit(self, keys: Sequence[BlockKey], request: RequestContext | None, stores_in_flight: int) -> bool:
        inner = self.inner
        if inner is not None and not inner.admit(keys, request, stores_in_flight):
            return False
        outcome = None if request is None else self._decided.get(request.req_id)
        if outcome is None:
            outcome = self._decide(keys, request)
            if request is not None:
                self._decided[request.req_id] = outcome
                if len(self._decided) > DECIDED_REQUESTS:
                    self._decided.popitem(last=False)
        self.watch.stored(keys, outcome)
        if outcome == ADMITTED:
            return True
        if outcome == OVERRIDDEN:
            self.overridden += len(keys)
            return True
        self.declined += len(keys)
        return False

    def _decide(self, keys: Sequence[BlockKey], request: RequestContext | None) -> int:
        """The outcome of a request's first store (its later stores follow it)."""
        if self._ends_a_conversation(request):
            return ENDED
        if self._worth_writing(keys):
            return ADMITTED
        return OVERRIDDEN if self.watch.fallen_back else DECLINED

    def _worth_writing(self, keys: Sequence[BlockKey]) -> bool:
        slot = self._slot_of(keys[-1]) if keys else None
        if slot is None:
            return True
        ratio = self._policy.relative_reuse(slot, self._horizon)
        return ratio is None or ratio >= DECLINE_BELOW

    def _ends_a_conversation(self, request: RequestContext | None) -> bool:
        """Whether ``request`` (at its first store) is the last request of a conversation that
        had an earlier store judged here (whatever the decision), by its hints (``kvtier_session``,
        ``kvtier_session_end``): its new blocks are then that conversation's own last turn, which
        nothing sends again. A conversation's first request may carry what other conversations
        share (a document, a code base), so it is judged by the policy even when it is also the
        last."""
        control = None if request is None else request.control
        hints = None if control is None else control.hints
        if hints is None or hints.session is None:
            return False
        session = session_digest(hints.session)
        sessions = self._sessions
        if hints.session_end:
            if session not in sessions:
                return False
            del sessions[session]
            return True
        sessions[session] = None
        sessions.move_to_end(session)
        if len(sessions) > SESSIONS_SEEN:
            sessions.popitem(last=False)
        return False

    def finished(self, result: JobResult, seconds: float) -> None:
        if self.inner is not None:
            self.inner.finished(result, seconds)

    def served(self, keys: Sequence[BlockKey]) -> None:
        self.watch.served(keys)

    def touched(self, keys: Sequence[BlockKey]) -> None:
        self.watch.touched(keys)

    def snapshot(self) -> BackpressureSnapshot | None:
        return None if self.inner is None else self.inner.snapshot()


def cascade_admission(
    settings: BackpressureSettings, label: str, rule: str = "all", primary: PrimaryTier | None = None,
    tier_blocks: int | None = None,
) -> CascadeAdmission | None:
    """The admission of the tier labelled ``label``: backpressure when ``settings`` enable it, else
    None (every cascade is taken); with ``rule`` ``"learned"`` (and the CPU tier ``primary``),
    a :class:`LearnedAdmission` around it for a tier of ``tier_blocks`` blocks (None: unknown)."""
    pressure = BackpressureAdmission(StoreLatencyMonitor(settings, label)) if settings.enabled else None
    if rule == "learned" and primary is not None:
        return LearnedAdmission(primary, tier_blocks, pressure)
    return pressure


def tier_admission(tier: SecondaryTier, index: int, backpressure: BackpressureSettings,
               primary: PrimaryTier | None) -> CascadeAdmission | None:
    """The cascade admission of ``tier``, the ``index``-th secondary tier: what its context's
    ``admission`` asks (see :func:`cascade_admission`), for a tier of its capacity in blocks."""
    context = getattr(tier, "context", None)
    rule = getattr(context, "admission", "all")
    block_bytes = getattr(context, "block_bytes", 0)
    capacity = None
    if rule == "learned":
        try:
            capacity = tier.usage().capacity_bytes
        except Exception:  # a tier that cannot tell: the policy's own horizon
            logger.warning("secondary tier #%d: usage() failed; learned admission uses the policy's horizon",
                           index, exc_info=True)
    blocks = capacity // tier.bytes_per_block(block_bytes) if capacity and block_bytes else None
    return cascade_admission(backpressure, tier_label(index, tier.tier_type), rule, primary, blocks)


__all__ = ["DECLINE_BELOW", "BackpressureAdmission", "CascadeAdmission", "LearnedAdmission", "cascade_admission",
           "tier_admission"]
