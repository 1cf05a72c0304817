"""The scheduler side: vLLM's ``OffloadingManager`` API on top of kvtier's :class:`TieringManager`.

Runs in vLLM's scheduler process. vLLM's OffloadingConnector calls every
method from its one scheduler thread; none of them blocks on I/O except
``reset_cache`` (drains in-flight tier copies) and ``shutdown``.

Translation, and why it is thin:

* **Keys.** vLLM's ``OffloadKey`` is its chained prefix hash plus a 4-byte
  KV-group index (36 bytes with the default sha256). kvtier accepts keys of up
  to :data:`~kvtier.tiers.format.MAX_KEY_BYTES` (64) bytes, so it is used as the
  kvtier key as it is: no rehash, and ``evicted_keys`` and KV events carry
  vLLM's own keys, all of them.
* **Requests.** ``ReqContext`` becomes a :class:`RequestContext` with the same
  ``req_id`` and the request's ``kv_transfer_params``.
* **Results.** Lookup results and offload policies map one to one by name;
  ``prepare_load`` / ``prepare_store`` return vLLM's ``CPULoadStoreSpec`` whose
  ids are rows of the shared region (picklable, so it crosses to workers).
* **Events.** kvtier's ``BlockEvent`` becomes ``OffloadingEvent`` with medium
  CPU for the CPU tier and STORAGE for secondary tiers (``ownership`` names the
  tier, e.g. ``"1:fs"``). With an :class:`~kvtier.engine_events.EngineEventStream`
  (the spec builds one when vLLM publishes KV events) the stream's control records
  travel in order with them, each as a ``BlockRemoved`` of :data:`CONTROL_KEY` whose
  ``ownership`` is the encoded record (a removal of a block nobody holds: a no-op for
  any other consumer). A request whose ``kv_transfer_params`` hold
  ``"kvtier_events": "snapshot"`` asks the stream for a snapshot, ``"mark"`` for a
  marker (``"kvtier_events_marker"``, default the request id).
* **Stats.** ``get_stats`` hands vLLM kvtier's per-tier figures
  (:mod:`kvtier.integrations.vllm.stats`), so they appear in the API server's
  ``/metrics`` and vLLM's stat log.
* **Per-request control.** kvtier's own keys in ``kv_transfer_params``
  (:mod:`kvtier.request_control`) and vLLM's ``kv_load_tiers`` filter (matched
  against each secondary tier's medium, STORAGE, and locality) both restrict the
  tiers a request loads from; the CPU tier is never filtered by vLLM's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierFilter,
)
from vllm.v1.kv_offload.base import LookupResult as VllmLookup
from vllm.v1.kv_offload.base import OffloadPolicy as VllmPolicy
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.engine_events import ControlRecord, EngineEventStream
from kvtier.errors import TierError
from kvtier.integrations.vllm.stats import VllmStatsReporter
from kvtier.keys import BlockKey
from kvtier.manager import TieringManager
from kvtier.manager.requests import FINISHED_KEPT
from kvtier.metrics import KvtierMetrics
from kvtier.primary import RESET_HOLD_STEPS
from kvtier.request_control import ControlProblem, ControlProblemLog, describe_value
from kvtier.telemetry import ManagerSnapshot
from kvtier.types import PRIMARY_LABEL, LookupResult, OffloadPolicy, RequestContext, RequestControl

logger = logging.getLogger(__name__)

CONTROL_KEY = OffloadKey(hashlib.sha256(b"kvtier-events control record").digest() + b"\xff\xff\xff\xff")
"""The key a control record rides on: a block hash no engine computes, KV-cache group 0xffffffff."""
EVENTS_PARAM = "kvtier_events"
MARKER_PARAM = "kvtier_events_marker"

RESET_RETRY_DRAIN = 0.001
"""Seconds a schedule step waits for the tiers to drain when it retries a pending reset (see ``reset_cache``)."""

_LOOKUP = {r: VllmLookup[r.name] for r in LookupResult}
_POLICY = {
    OffloadPolicy.BLOCK_LEVEL: VllmPolicy.CHUNK_LEVEL,
    OffloadPolicy.REQUEST_LEVEL: VllmPolicy.REQUEST_LEVEL,
}


class KvtierOffloadingManager(OffloadingManager):  # type: ignore[misc,unused-ignore]
    """Adapter from vLLM's OffloadingManager onto a :class:`TieringManager` it owns.

    ``promotion_memory`` bounds how many promoted keys remember their source
    tier until vLLM asks ``get_load_source`` (at least twice the CPU rows).
    ``metrics`` (kvtier's own Prometheus port) refreshes every
    ``metrics_interval`` seconds; vLLM's own metrics get kvtier's figures every
    ``stats_interval`` seconds and when the manager goes idle. ``events``: the
    stamped event stream over ``manager`` that :meth:`take_events` reports.
    ``reset_hold_steps``: after :meth:`reset_cache`, the CPU rows a worker copy may still
    touch stay out of use for this many schedule steps (see :meth:`reset_cache`).
    """

    def __init__(
        self,
        manager: TieringManager,
        *,
        promotion_memory: int = 65536,
        metrics: KvtierMetrics | None = None,
        metrics_interval: float = 1.0,
        stats_interval: float = 1.0,
        events: EngineEventStream | None = None,
        reset_hold_steps: int = RESET_HOLD_STEPS,
    ) -> None:
        self.manager = manager
        manager.primary.reset_hold_steps = max(1, reset_hold_steps)
        self.events = events
        # Malformed kvtier_events / kvtier_events_marker values: counted and logged like the manager's
        # own request settings (1st, 10th, 100th...), and reported with them.
        self._event_problems = ControlProblemLog(logger)
        self.stats_reporter = VllmStatsReporter(manager, interval=stats_interval, snapshot=self.kvtier_stats)
        self.metrics = metrics
        self._metrics_interval = metrics_interval
        self._metrics_due = 0.0
        self._promoted_cap = max(promotion_memory, 2 * manager.primary.num_blocks, 1024)
        self._contexts: dict[str, RequestContext] = {}
        # Finished requests' contexts, for the completions that arrive after on_request_finished
        # (vLLM's usual order for a request's last store): their params are not parsed (and their
        # malformed settings not counted) again. The FINISHED_KEPT most recent, like the manager's
        # own finished ids.
        self._finished: OrderedDict[str, RequestContext] = OrderedDict()
        self._promoted: OrderedDict[BlockKey, CacheHitSource] = OrderedDict()
        self._promotion_source = self._outermost_source()
        self._shut_down = False
        self._reset_pending = False  # a reset whose tiers did not drain in time: see reset_cache

    # --- translation helpers -------------------------------------------------------

    def _context(self, req: ReqContext, keep: bool = True) -> RequestContext:
        # Completions may arrive after on_request_finished (keep=False): they get the finished
        # request's context (see _finish), or one that is not retained for the request.
        # The request's kv_transfer_params come from the API client: parsed here, once, and not
        # kept (the context holds only the parsed control), so what a client sent costs nothing
        # after this call however large it was.
        ctx = self._contexts.get(req.req_id)
        if ctx is None and not keep:
            ctx = self._finished.get(req.req_id)
        if ctx is None:
            ctx = RequestContext(req.req_id)
            params = req.kv_transfer_params
            if params and isinstance(params, Mapping):
                ctx.control = self.manager.request_control(RequestContext(req.req_id, dict(params)))
            vllm_filter = getattr(req, "load_tier_filter", TierFilter.ALL)
            if vllm_filter is not TierFilter.ALL:
                ctx.control = self._apply_vllm_filter(self.manager.request_control(ctx), vllm_filter)
            if keep:
                self._contexts[req.req_id] = ctx
                self._finished.pop(req.req_id, None)  # an id used again: a new request
        return ctx

    def _finish(self, req: ReqContext) -> RequestContext:
        """The finishing request's context, kept among the finished ones for its late completions."""
        ctx = self._contexts.pop(req.req_id, None)
        if ctx is None:
            ctx = self._context(req, keep=False)
        finished = self._finished
        finished[req.req_id] = ctx
        finished.move_to_end(req.req_id)
        if len(finished) > FINISHED_KEPT:
            finished.popitem(last=False)
        return ctx

    def _apply_vllm_filter(self, control: RequestControl, vllm_filter: TierFilter) -> RequestControl:
        """Narrow ``control.load_from`` to the secondary tiers vLLM's ``kv_load_tiers`` allows."""
        allowed = {0} | {
            t.index
            for t in self.manager.tier_descriptors()[1:]
            if vllm_filter.allows(Medium.STORAGE, Locality.REMOTE if t.locality == "remote" else Locality.LOCAL)
        }
        load_from = frozenset(allowed if control.load_from is None else control.load_from & allowed)
        return dataclasses.replace(control, load_from=load_from)

    def _outermost_source(self) -> CacheHitSource:
        media = {t.medium for t in self.manager.tiers}
        if media and media <= {"disk", "storage", "fs"}:
            return CacheHitSource.DISK
        return CacheHitSource.EXTERNAL_UNSPECIFIED

    # --- lookups and loads -----------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> VllmLookup:
        if self._reset_pending:  # nothing stored before the reset is served (see reset_cache)
            return VllmLookup.MISS
        result = self.manager.lookup(key, self._context(req_context))
        # promoted_from: this lookup started a promotion (0: the block was being written already)
        if result is LookupResult.HIT_PENDING and self.manager.promoted_from:
            self._promoted[key] = self._promotion_source
            if len(self._promoted) > self._promoted_cap:
                self._promoted.popitem(last=False)
        return _LOOKUP[result]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return self._promoted.pop(key, CacheHitSource.HOST)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        slots = self.manager.prepare_load(list(keys), self._context(req_context))
        return CPULoadStoreSpec(slots.tolist())

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.manager.touch(list(keys), self._context(req_context))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.manager.complete_load(list(keys), self._context(req_context, keep=False))

    # --- stores --------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        if self._reset_pending:  # nothing is stored until the reset is done (see reset_cache)
            return None
        result = self.manager.prepare_store(list(keys), self._context(req_context))
        if result is None:
            return None
        return PrepareStoreOutput(
            keys_to_store=list(result.keys_to_store),
            store_spec=CPULoadStoreSpec(result.slots.tolist()),
            evicted_keys=list(result.evicted_keys),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.manager.complete_store(list(keys), self._context(req_context, keep=False), success)

    # --- requests and steps -----------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        ctx = self._context(req_context)
        params = req_context.kv_transfer_params
        if self.events is not None and isinstance(params, Mapping) and params.get(EVENTS_PARAM) is not None:
            self._event_request(ctx.req_id, params)
        policy = self.manager.on_new_request(ctx)
        return RequestOffloadingContext(policy=_POLICY[policy])

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.manager.on_request_finished(self._finish(req_context))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.manager.on_schedule_end()
        if self._reset_pending and not self.manager.has_pending_work():  # the tiers finished: reset now
            self._reset(RESET_RETRY_DRAIN)
        if self.metrics is not None:
            now = time.monotonic()
            if now >= self._metrics_due:  # a stats snapshot per interval, not per step
                self._metrics_due = now + self._metrics_interval
                self.metrics.update(self.kvtier_stats())

    def has_pending_work(self) -> bool:
        return self.manager.has_pending_work() or (self.events is not None and self.events.has_pending_output())

    def _event_request(self, req_id: str, params: Mapping[str, Any]) -> None:
        """A request asked the event stream for a snapshot or a marker (see the module docstring);
        ``params`` come from the API client: only these two keys are read, and shown bounded."""
        assert self.events is not None
        what = params.get(EVENTS_PARAM)
        if type(what) is str and what == "snapshot":  # a str subclass's __eq__ is the client's
            if not self.events.request_snapshot():
                logger.debug("kvtier events: snapshot asked by %.80s ignored (one is under way or was sent "
                             "within %.0f s)", req_id, self.events.snapshot_interval)  # fmt: skip
        elif type(what) is str and what == "mark":
            marker = params.get(MARKER_PARAM, req_id)
            try:
                self.events.mark(marker)
            except ValueError as exc:
                message = f"{MARKER_PARAM}: {exc}"
                self._event_problems.record(req_id, [ControlProblem(MARKER_PARAM, "not_marker", message)])
        else:
            message = f"{EVENTS_PARAM} must be 'snapshot' or 'mark', got {describe_value(what)}"
            self._event_problems.record(req_id, [ControlProblem(EVENTS_PARAM, "not_events_request", message)])

    def take_events(self) -> Iterable[OffloadingEvent]:
        out: list[OffloadingEvent] = []
        items = self.manager.take_events() if self.events is None else self.events.take()
        for item in items:
            if isinstance(item, ControlRecord):
                out.append(
                    OffloadingEvent(keys=[CONTROL_KEY], medium=Medium.STORAGE, removed=True, ownership=item.encode())
                )
                continue
            keys = list(item.keys)
            if not keys:
                continue
            primary = item.tier == PRIMARY_LABEL
            out.append(
                OffloadingEvent(
                    keys=keys,
                    medium=Medium.CPU if primary else Medium.STORAGE,
                    removed=item.removed,
                    ownership=None if primary else item.tier,
                )
            )
        return out

    def reset_cache(self) -> None:
        """Empty the CPU tier (persistent tiers keep their data). vLLM calls it between steps
        while worker copies of earlier jobs may still run: it flushes them during the next step's
        execution, discarding their completions. The rows those copies write or read are held out
        of use (:meth:`PrimaryTier.reset <kvtier.primary.PrimaryTier.reset>`) for
        ``reset_hold_steps`` schedule steps, so no promotion lands on a row a stale store is still
        writing or a load is still reading.

        Never raises into vLLM (its connector's state is half reset by then: the next step would
        fail). If a secondary tier cannot finish its jobs within ``drain_timeout`` (they may still
        read or write CPU rows), the reset is pending: logged as an error, every lookup answers
        MISS and every store is refused (nothing from before the reset is served, nothing new is
        cascaded), and the first schedule step that finds no tier job in flight resets it (waiting at
        most ``RESET_RETRY_DRAIN`` seconds)."""
        self._promoted.clear()
        self._reset(None)
        if self._reset_pending:
            logger.error("kvtier: reset_cache is pending: a secondary tier has not finished its jobs (they may "
                         "still use CPU rows); until it has, every lookup is a MISS and nothing is stored")

    def _reset(self, drain_timeout: float | None) -> None:
        """Reset the manager (through the event stream, if any); pending if a tier fails to drain."""
        try:
            if self.events is None:
                self.manager.reset_cache(drain_timeout)
            else:
                self.events.reset_cache(drain_timeout)
        except TierError as exc:
            if not self._reset_pending:
                logger.error("kvtier: reset_cache: %s", exc)
            self._reset_pending = True
            return
        if self._reset_pending:
            logger.warning("kvtier: the pending reset_cache is done: the CPU tier serves and stores again")
        self._reset_pending = False

    def get_stats(self) -> OffloadingConnectorStats | None:
        """kvtier's figures since the last report, for vLLM's metrics (see
        :class:`~kvtier.integrations.vllm.stats.VllmStatsReporter`); None when not due."""
        if self._shut_down:
            return None
        return self.stats_reporter.report()

    def kvtier_stats(self) -> ManagerSnapshot:
        """kvtier's typed snapshot (CPU tier, each secondary tier, manager); ``.as_dict()`` is JSON-able.
        The malformed ``kvtier_events`` settings this adapter saw are in ``manager.request_control_problems``."""
        snap = self.manager.stats()
        snap.manager.request_control_problems.update(self._event_problems.counts())
        return snap

    def shutdown(self) -> None:
        """Shut down every tier and release the CPU region. Idempotent; raises on tier failure."""
        if self._shut_down:
            return
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.manager.shutdown()
        self._shut_down = True
        self._contexts.clear()
        self._finished.clear()
        self._promoted.clear()
