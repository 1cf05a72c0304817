"""TieringManager: the scheduler-side orchestrator of the CPU tier and the secondary tiers.

Every method except :meth:`reset_cache` and :meth:`shutdown` is called from
the engine's scheduler thread and does bookkeeping only: it never moves bytes
and never blocks on I/O. Bytes move in engine workers (device <-> CPU rows)
and in each secondary tier's I/O threads (CPU rows <-> tier), which report
completion through ``poll_finished``.

Contract per engine step (DESIGN.md section 5):

* Tier jobs are polled at most once per step, at the first ``lookup``,
  ``prepare_load`` or ``prepare_store`` of the step (or in ``on_schedule_end``),
  so pins released by finished cascades count in the eviction decisions.
* ``lookup`` answers HIT / HIT_PENDING / RETRY / MISS. On a CPU miss the
  secondary tiers are asked in order; on the first secondary HIT a CPU row is
  reserved at once (a second lookup of the key, from any request, sees
  HIT_PENDING) and the load is submitted in ``on_schedule_end``, batched per
  (tier, request). If no row can be reserved the answer is MISS.
* ``complete_store(success=True)`` cascades the stored blocks to every
  secondary tier, pinning their rows once per tier until that tier reports the
  job. A failed store cascades nothing.
* A tier's ``on_request_finished`` runs only once the request finished and no
  device store of it is still outstanding (no more cascades can be issued).
* Backpressure (:mod:`kvtier.backpressure`): a tier whose cascade jobs got slow
  (moving average of their latency above a high mark) gets no new cascades
  until the average falls below a low mark; loads and promotions never wait.
* Per-request control (:mod:`kvtier.request_control`): a request's params may
  restrict the tiers it loads from, whether its blocks are stored, and the
  tiers they cascade to.
* :meth:`TieringManager.stats` returns a typed snapshot
  (:class:`~kvtier.telemetry.ManagerSnapshot`) of every tier: the tier's own
  counters plus what the manager observed (lookup latencies, job bytes and
  seconds, failures by kind, jobs in flight, backpressure).

The boundary: every method taking keys accepts ``bytes`` keys of 1 to
:data:`~kvtier.tiers.format.MAX_KEY_BYTES` bytes and raises
:class:`~kvtier.errors.InvalidKeyError` at the call for anything else (nothing
reaches a tier). Once :meth:`TieringManager.shutdown` was called, every method
except ``shutdown``, ``is_shut_down`` and ``stats`` raises
:class:`~kvtier.errors.ManagerClosedError`. ``stats`` never raises because a
tier misbehaves.

Secondary tiers are numbered from 1 in logs, labels and errors; the CPU tier is 0.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from time import perf_counter
from typing import Any, NoReturn

import numpy as np

from kvtier.backpressure import BackpressureSettings, StoreLatencyMonitor
from kvtier.errors import (
    ConfigError,
    InvalidKeyError,
    ManagerClosedError,
    RegionBusyError,
    TierError,
    TierFailure,
    TierShutdownError,
    TierShutdownTimeout,
    clear_exception_frames,
)
from kvtier.keys import BlockKey, Namespace
from kvtier.policies import DEFAULT_POLICY, resolve_policy
from kvtier.primary import PrepareStoreResult, PrimaryTier
from kvtier.region import SharedRegion
from kvtier.request_control import CONTROL_KEYS, TierDescriptor, parse_control, tier_locality
from kvtier.telemetry import (
    LookupCounts,
    ManagerCounters,
    ManagerSnapshot,
    PolicySnapshot,
    TierSnapshot,
    TierTelemetry,
    TransferTotals,
)
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob
from kvtier.tiers.format import MAX_KEY_BYTES
from kvtier.tiers.registry import create_tier, validate_tier_options
from kvtier.types import (
    DEFAULT_CONTROL,
    PRIMARY_LABEL,
    BlockEvent,
    LookupResult,
    OffloadPolicy,
    PrefixLookup,
    RequestContext,
    RequestControl,
    tier_label,
)
from kvtier.units import rows_that_fit

logger = logging.getLogger(__name__)

# The answers as module constants: the hot paths compare against them without an attribute load.
_HIT, _HIT_PENDING, _RETRY, _MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY, LookupResult.MISS
IN_FLIGHT = -1
"""The CPU tier's ref count of a block whose write is in flight (see :mod:`kvtier.primary`)."""

DEFAULT_SHUTDOWN_TIMEOUT = 120.0
"""Seconds :meth:`TieringManager.shutdown` gives all secondary tiers together."""

LOOKUP_TIMING_EVERY = 8
"""One lookup in this many is timed for the per-tier latency histograms (timing every one would
add a fifth to the cost of a CPU hit); RETRY answers and the answers after them are always timed."""


def _key_error(key: object) -> InvalidKeyError:
    if not isinstance(key, bytes):
        return InvalidKeyError(f"block keys must be bytes, got {type(key).__name__} {key!r:.80}")
    return InvalidKeyError(
        f"block key of {len(key)} bytes ({key[:16].hex()}...): keys must be 1 to {MAX_KEY_BYTES} bytes"
    )


def _check_shutdown_timeout(timeout: float | None) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not timeout >= 0):
        raise ConfigError(f"shutdown_timeout must be >= 0 seconds or None, got {timeout!r}")


def _by_seq(state: _RequestState) -> int:
    return state.seq


def _checked_keys(keys: Iterable[BlockKey]) -> list[BlockKey]:
    """``keys`` as a list, every one checked; the cost is a type and a length test per key."""
    out = keys if type(keys) is list else list(keys)
    for key in out:
        if (type(key) is not bytes and not isinstance(key, bytes)) or not 0 < len(key) <= MAX_KEY_BYTES:
            raise _key_error(key)
    return out


ManagerStats = ManagerCounters
"""The manager's counters (the name of earlier releases for :class:`~kvtier.telemetry.ManagerCounters`)."""


class _ShutdownRun:
    """One call of a tier's ``shutdown()`` on its own daemon thread, so the manager can stop
    waiting for it (a hung tier is abandoned, never waited on past its share of the deadline)."""

    def __init__(self, tier: SecondaryTier, pos: int) -> None:
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(tier,), name=f"kvtier-shutdown-tier{pos + 1}", daemon=True
        )
        self._thread.start()

    def _run(self, tier: SecondaryTier) -> None:
        try:
            tier.shutdown()
        except BaseException as exc:  # handed to the manager's thread, KeyboardInterrupt included
            self.error = exc
        finally:
            self._done.set()

    def wait(self, timeout: float | None) -> bool:
        """True once the call returned or raised (``error`` then says which)."""
        return self._done.wait(timeout)


class _Job:
    """A tier job in flight (a plain slotted class: one is made per job on the scheduler thread)."""

    __slots__ = ("is_promotion", "keys", "req_id", "slots", "submitted", "tier_index")

    def __init__(self, tier_index: int, is_promotion: bool, keys: list[BlockKey], slots: list[int],
                 req_id: str | None, submitted: float) -> None:
        self.tier_index = tier_index
        self.is_promotion = is_promotion
        self.keys = keys
        self.slots = slots  # the rows of ``keys`` (a cascade's stay pinned until the job is reported)
        self.req_id = req_id
        self.submitted = submitted  # perf_counter() at submit


@dataclass(eq=False)
class _RequestState:
    request: RequestContext
    seq: int  # creation order: step-end work visits requests in this order
    request_level_tiers: list[int] = field(default_factory=list)
    pending_store_keys: set[BlockKey] = field(default_factory=set)
    parked_cascades: list[BlockKey] = field(default_factory=list)
    unsubmitted_promotions: int = 0
    finished: bool = False
    chain_tail: BlockKey | None = None  # the last block loaded or stored: the parent of the next
    stored_tail: bool = False  # chain_tail was stored by this request (a next store continues it)
    in_step: bool = False  # listed in the manager's _step_states (promotions or parked cascades)


@dataclass
class _PendingPromotion:
    request: RequestContext | None
    keys: list[BlockKey] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


class TieringManager:
    """Coordinates a :class:`PrimaryTier` with secondary tiers; see the module docstring.

    Build one with :meth:`create` (which also makes the shared region and the
    tiers, cleaning up in reverse order if any step fails), or pass ready parts.
    The manager owns the parts it is given: :meth:`shutdown` shuts them down.
    """

    def __init__(
        self,
        primary: PrimaryTier,
        tiers: Sequence[SecondaryTier] = (),
        *,
        drain_timeout: float | None = 120.0,
        shutdown_timeout: float | None = DEFAULT_SHUTDOWN_TIMEOUT,
        backpressure: BackpressureSettings | None = None,
        lookup_timing_every: int = LOOKUP_TIMING_EVERY,
    ) -> None:
        _check_shutdown_timeout(shutdown_timeout)
        if isinstance(lookup_timing_every, bool) or not isinstance(lookup_timing_every, int) or lookup_timing_every < 1:
            raise ConfigError(f"lookup_timing_every must be an integer >= 1, got {lookup_timing_every!r}")
        self.primary = primary
        self.tiers: list[SecondaryTier] = list(tiers)
        self.drain_timeout = drain_timeout
        self.shutdown_timeout = shutdown_timeout
        self._jobs: dict[int, _Job] = {}
        self._next_job_id = 1
        self._requests: dict[str, _RequestState] = {}
        self._next_request_seq = 0
        # Requests with promotions of this step or parked cascades: the only ones step end visits.
        self._step_states: list[_RequestState] = []
        self._pending_promotions: dict[tuple[int, str | None], _PendingPromotion] = {}
        # The last promotion's (tier, request object, its pending entry, its state): the next
        # one of the same request from the same tier (a prefix scan's run) skips both lookups.
        # Valid until the step's promotions are submitted or dropped (set to None then).
        self._last_promotion: tuple[int, RequestContext | None, _PendingPromotion, _RequestState | None] | None = None
        self._polled_this_step = False
        self._tiers_down: set[int] = set()
        self._closing = False  # shutdown() was called: only shutdown(), is_shut_down and stats() remain
        self._shutdown_complete = False
        self._shutdown_runs: dict[int, _ShutdownRun] = {}
        self._stats = ManagerCounters()
        self._logged_call_errors: set[tuple[int, str]] = set()
        # Index 0 is the CPU tier, index n secondary tier n (as in labels).
        self._telemetry = [TierTelemetry() for _ in range(len(self.tiers) + 1)]
        self._cpu_lookup_times = self._telemetry[0].lookup_seconds.pending  # appended to on the hot path
        # Per live secondary tier, in order: (position, tier, its telemetry, keys that answered RETRY).
        self._secondary: list[tuple[int, SecondaryTier, TierTelemetry, dict[BlockKey, float]]] = [
            (pos, tier, self._telemetry[pos + 1], self._telemetry[pos + 1].retry_since)
            for pos, tier in enumerate(self.tiers)
        ]
        self._step_end_tiers = self._tiers_with_step_end()
        self.lookup_timing_every = lookup_timing_every
        self._init_lookup_state(primary)
        self.backpressure = backpressure if backpressure is not None else BackpressureSettings()
        self._pressure: list[StoreLatencyMonitor | None] = [
            StoreLatencyMonitor(self.backpressure, self.tier_label(pos + 1)) if self.backpressure.enabled else None
            for pos in range(len(self.tiers))
        ]
        self._descriptors = [TierDescriptor(0, PRIMARY_LABEL, "primary", "local")] + [
            TierDescriptor(pos + 1, self.tier_label(pos + 1), tier.tier_type,
                           tier_locality(tier.medium, getattr(tier, "locality", None)))
            for pos, tier in enumerate(self.tiers)
        ]  # fmt: skip
        self._logged_control_errors: set[str] = set()
        self.promoted_from = 0
        """After a lookup answered HIT_PENDING: the index of the secondary tier it started a
        promotion from, or 0 if the block was already being written into the CPU tier (a device
        store or an earlier promotion). Meaningless after other answers. Lets an engine adapter
        tell where a hit came from without a second lookup."""

    def _init_lookup_state(self, primary: PrimaryTier) -> None:
        """The state of the lookup paths (part of ``__init__``)."""
        # Keys answered HIT this step: the engine may still prepare_load them in this
        # step, so no eviction (for a store or a promotion) may take them before it ends.
        # A HIT only appends its key to a log (never rebound: the lookup fast path holds its
        # ``append``); the set is brought up to date from the log before an eviction may run.
        self._step_hits: set[BlockKey] = set()
        self._hit_log: list[BlockKey] = []
        self._step_hit = self._hit_log.append
        # The lookup fast path (see lookup): True once this step was polled, while the manager
        # is open; it then answers a CPU hit from the CPU tier's index without a call.
        self._steady = False
        self._slot_get, self._refs = primary.hot_path()
        # Lookup counting without a counter per HIT: every lookup that reaches the CPU tier
        # counts ``_countdown`` down; the one that takes it to 0 is timed and adds
        # ``lookup_timing_every`` to ``_counted`` as it starts the next round. So the CPU tier
        # was asked ``_counted - _countdown`` times, and the HITs are that minus the other
        # answers, which the slower paths count one by one.
        self._countdown = 1
        self._counted = 1
        self._cpu_pending = 0  # CPU tier answers: write in flight
        self._cpu_misses = 0  # CPU tier answers: absent
        self._answered_pending = 0  # the manager's answers other than HIT
        self._answered_retry = 0
        self._answered_miss = 0

    # --- construction ----------------------------------------------------------------

    @classmethod
    def create(
        cls,
        *,
        namespace: Namespace,
        block_bytes: int | None = None,
        num_cpu_blocks: int | None = None,
        cpu_bytes: int | None = None,
        policy: str = DEFAULT_POLICY,
        tiers: Sequence[dict[str, Any]] = (),
        region_name: str | None = None,
        shm_dir: str | os.PathLike[str] = "/dev/shm",
        expected_mappers: int = 1,
        prefault: bool = True,
        pin: bool = False,
        sweep_stale: bool = True,
        drain_timeout: float | None = 120.0,
        shutdown_timeout: float | None = DEFAULT_SHUTDOWN_TIMEOUT,
        backpressure: BackpressureSettings | None = None,
        events: bool = True,
    ) -> TieringManager:
        """Build the region, the CPU tier and each secondary tier (``{"type": ..., **options}``).

        ``block_bytes`` is the payload of one block (one CPU row before page
        rounding); by default the namespace's geometry gives it. An engine whose
        rows are opaque bytes passes it directly. If any step fails, the tiers
        already built are shut down in reverse order, the region is released, and
        the original error is raised. ``backpressure`` (default: on, with the
        defaults of :class:`~kvtier.backpressure.BackpressureSettings`) decides
        when cascades to a slow tier are skipped. ``events``: the CPU tier records
        its stored/removed events for :meth:`take_events`; an engine that never
        takes them passes False (vLLM without KV cache events: vLLM's own manager
        records none then either), sparing an allocation per eviction.
        """
        if block_bytes is None:
            if namespace.geometry is None:
                raise ConfigError("give block_bytes: the namespace has no KV geometry to derive it from")
            block_bytes = namespace.geometry.bytes_per_block
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
            raise ConfigError(f"block_bytes must be a positive integer, got {block_bytes!r}")
        if num_cpu_blocks is None:
            if cpu_bytes is None:
                raise ConfigError("give the CPU tier a size: num_cpu_blocks or cpu_bytes")
            num_cpu_blocks = rows_that_fit(cpu_bytes, block_bytes)
        # Everything that can be checked without side effects is checked first.
        _check_shutdown_timeout(shutdown_timeout)
        if isinstance(policy, str):
            resolve_policy(policy)
        for index, spec in enumerate(tiers, start=1):
            validate_tier_options(spec, where=f"secondary tier #{index}")
        if sweep_stale:
            SharedRegion.sweep_stale(shm_dir, remove=True)
        name = region_name or f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        region = SharedRegion(
            name, num_cpu_blocks, block_bytes, expected_mappers=expected_mappers, shm_dir=shm_dir,
            prefault=prefault, pin=pin,
        )
        built: list[SecondaryTier] = []
        primary: PrimaryTier | None = None
        context: TierContext | None = None
        try:
            primary = PrimaryTier(region, block_bytes, policy, record_events=events)
            for index, spec in enumerate(tiers, start=1):
                context = TierContext(rows=region.rows, block_bytes=block_bytes, namespace=namespace, index=index)
                built.append(create_tier(spec, context))
                context = None
            return cls(
                primary, built, drain_timeout=drain_timeout, shutdown_timeout=shutdown_timeout,
                backpressure=backpressure,
            )
        except BaseException as exc:
            # The failed constructors' frames (kept alive by the exception's traceback, which
            # the caller may keep) still reference the CPU rows: drop their locals, or the
            # mapping (and its memory) would outlive this call.
            context = None
            clear_exception_frames(exc)
            cls._cleanup_failed_construction(region, primary, built)
            raise

    @staticmethod
    def _cleanup_failed_construction(
        region: SharedRegion, primary: PrimaryTier | None, built: list[SecondaryTier]
    ) -> None:
        for tier in reversed(built):
            try:
                tier.shutdown()
                tier.context.release_rows()
            except Exception:
                logger.exception(
                    "cleanup after failed construction: secondary tier #%d (type=%s, class=%s) failed to shut down",
                    tier.context.index, tier.tier_type, type(tier).__qualname__,
                )
        built.clear()
        if primary is not None:
            primary.rows = None
        try:
            region.close()
        except RegionBusyError:
            # Something outside kvtier still holds a view of the rows: make sure the path cannot
            # leak, and let the mapping go with the last reference.
            logger.warning(
                "region %s still referenced after failed construction; its path is unlinked, its memory is "
                "returned when the last view of its rows is dropped", region.name,
            )
            region._unlink_if_ours()

    # --- properties -------------------------------------------------------------------

    @property
    def region(self) -> SharedRegion:
        return self.primary.region

    @property
    def rows(self) -> np.ndarray:
        """A ``(num_blocks, row_stride)`` uint8 view of the CPU rows (for workers in this process)."""
        return self.region.rows

    @property
    def block_bytes(self) -> int:
        return self.primary.block_bytes

    def tier_label(self, index: int) -> str:
        """``"0:primary"`` or ``"<n>:<type>"`` for secondary tier n (1-based)."""
        return tier_label(index, "primary" if index == 0 else self.tiers[index - 1].tier_type)

    def _tier_call_failed(self, pos: int, call: str) -> None:
        """A tier raised from a scheduler-side call: count it, log it once per (tier, call).

        The engine's scheduler must never crash because a tier misbehaves; the
        call is treated as answered with its safe default (MISS, no results, ...).
        """
        self._stats.tier_call_errors += 1
        self._telemetry[pos + 1].fail("call_error")
        if (pos, call) not in self._logged_call_errors:
            self._logged_call_errors.add((pos, call))
            tier = self.tiers[pos]
            logger.exception(
                "secondary tier #%d (type=%s, class=%s) raised from %s(); treated as its safe default "
                "(further errors of this call are only counted)",
                pos + 1, tier.tier_type, type(tier).__qualname__, call,
            )

    def _refuse(self, call: str) -> NoReturn:
        raise ManagerClosedError(
            f"TieringManager.{call}() called after shutdown(): only shutdown(), is_shut_down and "
            "stats() may be called now"
        )

    def _open_keys(self, call: str, keys: Iterable[BlockKey]) -> list[BlockKey]:
        if self._closing:
            self._refuse(call)
        return _checked_keys(keys)

    # --- per-step polling ----------------------------------------------------------------

    def _poll_once(self) -> None:
        if not self._polled_this_step:
            self._polled_this_step = True
            self._steady = not self._closing
            self._poll_all()

    def _poll_all(self) -> None:
        for pos, tier, _, _ in self._secondary:
            try:
                results = tier.poll_finished()
            except Exception:
                self._tier_call_failed(pos, "poll_finished")
                continue
            for result in results:
                self._finish_job(pos, result)

    def _finish_job(self, pos: int, result: JobResult) -> None:
        job = self._jobs.get(result.job_id)
        if job is None or job.tier_index != pos:
            self._stats.unknown_job_results += 1
            logger.error("secondary tier #%d reported unknown job %d; ignored", pos + 1, result.job_id)
            return
        del self._jobs[result.job_id]
        telemetry = self._telemetry[pos + 1]
        seconds = result.seconds if result.seconds > 0 else perf_counter() - job.submitted
        if job.is_promotion:
            telemetry.loads_in_flight -= 1
            if result.successful_keys is None:  # all or nothing
                ok, failed = (job.keys, []) if result.success else ([], job.keys)
            else:
                ok = result.succeeded(job.keys)
                ok_set = set(ok)
                failed = [k for k in job.keys if k not in ok_set]
            if ok:
                self.primary.complete_write(ok, True)
            if failed:
                self.primary.complete_write(failed, False)
            self._stats.promotions_succeeded += len(ok)
            self._stats.promotions_failed += len(failed)
            telemetry.read.add(len(ok), result.bytes_moved, seconds)
            if failed:
                telemetry.fail("promotion_job_failed")
                logger.debug("promotion job %d from tier #%d: %d of %d keys failed (%s)",
                             result.job_id, pos + 1, len(failed), len(job.keys), result.error)
        else:
            telemetry.stores_in_flight -= 1
            self.primary.unpin_slots(job.keys, job.slots)
            if result.success:
                self._stats.cascades_succeeded += len(job.keys)
                telemetry.written.add(len(job.keys), result.bytes_moved, seconds)
            else:
                self._stats.cascades_failed += len(job.keys)
                telemetry.written.add(len(result.succeeded(job.keys)), result.bytes_moved, seconds)
                telemetry.fail("cascade_job_failed")
            monitor = self._pressure[pos]
            # A sample only from jobs that reached the medium: stores skipped because the tier
            # held the keys, or shed at once, say nothing about its latency.
            if monitor is not None and (result.bytes_moved > 0 or (not result.success and result.seconds > 0)):
                monitor.observe(seconds)

    def _new_job(self, pos: int, keys: list[BlockKey], slots: list[int], rows: np.ndarray, promotion: bool,
                 request: RequestContext | None, tier_keys: list[BlockKey] | None = None) -> TransferJob:
        """Register a job of tier ``pos`` moving ``keys`` (rows ``slots``, also as the array
        ``rows`` the tier gets) and make it; the tier gets ``tier_keys`` (default ``keys``)."""
        job_id = self._next_job_id
        self._next_job_id = job_id + 1
        req_id = None if request is None else request.req_id
        self._jobs[job_id] = _Job(pos, promotion, keys, slots, req_id, perf_counter())
        return TransferJob(job_id, keys if tier_keys is None else tier_keys, rows, promotion, request)

    # --- lookups and loads ---------------------------------------------------------------

    def lookup(self, key: BlockKey, request: RequestContext | None = None) -> LookupResult:
        """Where is ``key``? Starts a promotion on a secondary hit (see the module docstring).

        A CPU hit is answered from the CPU tier's index, without a call per tier;
        misses ask the secondary tiers. :meth:`lookup_prefix` answers a request's
        run of keys in one call.
        """
        # Fast path: in a step already polled, for a request with the default control, a ready
        # CPU block is answered here and a CPU miss goes straight to the secondary tiers; the
        # round's timed lookup goes to _timed_lookup. Anything else takes _lookup.
        if type(key) is bytes and self._steady and (request is None or request.control is DEFAULT_CONTROL):
            countdown = self._countdown - 1
            if countdown:
                slot = self._slot_get(key)
                if slot is not None:  # the key equals a stored one, so its length was checked
                    if self._refs[slot] != IN_FLIGHT:
                        self._countdown = countdown
                        self._step_hit(key)
                        return _HIT
                elif 0 < len(key) <= MAX_KEY_BYTES:
                    self._countdown = countdown
                    self._cpu_misses += 1
                    if self._secondary:
                        return self._lookup_secondary(key, request, None, 0.0)
                    self._answered_miss += 1
                    return _MISS
            elif 0 < len(key) <= MAX_KEY_BYTES:
                return self._timed_lookup(key, request, None)
        return self._lookup(key, request)

    def _lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        """:meth:`lookup` in full: checks, the step's poll, control, then the CPU tier and the
        secondary tiers."""
        if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES or self._closing:
            self._open_keys("lookup", (key,))  # raises, unless a valid key of a bytes subclass
        self._poll_once()
        allowed = None if request is None else (request.control or self.request_control(request)).load_from
        if allowed is not None and 0 not in allowed:
            self._answered_miss += 1
            return _MISS  # the request may not load anything: every load goes through the CPU tier
        countdown = self._countdown - 1
        if not countdown:
            return self._timed_lookup(key, request, allowed)
        self._countdown = countdown
        slot = self._slot_get(key)
        if slot is not None:
            return self._cpu_answer(key, self._refs[slot] == IN_FLIGHT)
        self._cpu_misses += 1
        if self._secondary:
            return self._lookup_secondary(key, request, allowed, 0.0)
        self._answered_miss += 1
        return _MISS

    def _timed_lookup(
        self, key: BlockKey, request: RequestContext | None, allowed: frozenset[int] | None
    ) -> LookupResult:
        """The lookup that ends a round of ``lookup_timing_every``: the CPU tier's answer and
        each secondary tier's are timed (the per-tier ``lookup_seconds`` histograms)."""
        self._countdown = every = self.lookup_timing_every
        self._counted += every
        start = perf_counter()
        slot = self._slot_get(key)
        pending = slot is not None and self._refs[slot] == IN_FLIGHT
        now = perf_counter()
        self._cpu_lookup_times.append(now - start)
        if slot is not None:
            return self._cpu_answer(key, pending)
        self._cpu_misses += 1
        if self._secondary:
            return self._lookup_secondary(key, request, allowed, now)
        self._answered_miss += 1
        return _MISS

    def _cpu_answer(self, key: BlockKey, pending: bool) -> LookupResult:
        """The answer for a block the CPU tier holds: HIT_PENDING while its write is in flight."""
        if pending:
            self._cpu_pending += 1
            self._answered_pending += 1
            self.promoted_from = 0
            return _HIT_PENDING
        self._step_hit(key)
        return _HIT

    def lookup_prefix(self, keys: Sequence[BlockKey], request: RequestContext | None = None) -> PrefixLookup:
        """Look up a request's blocks in prefix order, in one call: the engine's prefix scan.

        Same answers and the same effects (promotions started, counters, the
        step's HITs protected from eviction) as calling :meth:`lookup` on each
        key in order, stopping after the first MISS, as vLLM's connector does
        with ``lookup``; a run of CPU hits costs about a dictionary probe per
        key. Returns a :class:`~kvtier.types.PrefixLookup`: the answers, how
        many leading keys are ready to load now (``ready``), and whether to ask
        again next step (``deferred``: a key before the first MISS answered
        HIT_PENDING or RETRY). A bad key raises like :meth:`lookup`, after the
        keys before it were looked up. Scheduler thread only; never blocks.
        """
        if self._closing:
            self._refuse("lookup_prefix")
        if type(keys) is not list and type(keys) is not tuple:
            keys = list(keys)
        answers: list[LookupResult] = []
        n = len(keys)
        i = 0
        ready = -1  # the index of the first answer other than HIT, once known
        while i < n:
            i = self._lookup_run(keys, i, request, answers)
            if i < n:
                answer = self._lookup(keys[i], request)
                answers.append(answer)
                i += 1
                if answer is not _HIT:
                    if ready < 0:
                        ready = i - 1
                    if answer is _MISS:
                        break
        if ready < 0:  # every key answered HIT
            return PrefixLookup(answers, n, n, False)
        hits, pending = answers.count(_HIT), answers.count(_HIT_PENDING)
        return PrefixLookup(answers, ready, hits + pending, bool(pending) or _RETRY in answers)

    def _lookup_run(
        self, keys: Sequence[BlockKey], i: int, request: RequestContext | None, answers: list[LookupResult]
    ) -> int:
        """Answer the CPU hits of :meth:`lookup_prefix` from ``keys[i]`` on with the fast path's
        checks, the round's timed lookup included when it is a hit; returns the index of the
        first key :meth:`_lookup` must answer."""
        if not self._steady or not (request is None or request.control is DEFAULT_CONTROL):
            return i
        slot_get, refs, step_hit = self._slot_get, self._refs, self._step_hit
        n = len(keys)
        start = i
        countdown = self._countdown
        while i < n:
            key = keys[i]
            if type(key) is not bytes:
                break
            if countdown > 1:
                slot = slot_get(key)
                if slot is None or refs[slot] == IN_FLIGHT:
                    break
                countdown -= 1
            else:  # the round's timed lookup (as in _timed_lookup), answered here while it is a hit
                began = perf_counter()
                slot = slot_get(key)
                if slot is None or refs[slot] == IN_FLIGHT:
                    break
                self._cpu_lookup_times.append(perf_counter() - began)
                countdown = self.lookup_timing_every
                self._counted += countdown
            step_hit(key)
            i += 1
        self._countdown = countdown
        if i > start:
            answers += [_HIT] * (i - start)
        return i

    def _lookup_secondary(
        self, key: BlockKey, request: RequestContext | None, allowed: frozenset[int] | None, now: float
    ) -> LookupResult:
        """Ask the tiers ``allowed`` (indices; None: all) in order, after a CPU miss, and count
        the answer. ``now`` is when the first is asked if this lookup is timed, else 0. A
        tier's RETRY, and its answer after one, are always timed (``lookup_async_seconds``)."""
        retry = False
        for pos, tier, telemetry, retrying in self._secondary:
            if allowed is not None and pos + 1 not in allowed:
                continue
            try:
                answer = tier.lookup(key, request)
            except Exception:
                self._tier_call_failed(pos, "lookup")
                continue
            if now:
                done = perf_counter()
                telemetry.lookup_seconds.pending.append(done - now)
                now = done
            if answer is _MISS:
                if retrying:
                    telemetry.answered(key, now or perf_counter())
                continue
            if answer is _RETRY:
                telemetry.retried(key, now or perf_counter())
                retry = True
                continue
            if retrying:
                telemetry.answered(key, now or perf_counter())
            if answer is _HIT:
                if self._start_promotion(pos, key, request):
                    self._answered_pending += 1
                    return _HIT_PENDING
                self._answered_miss += 1  # no CPU row for it: MISS, whatever other tiers said
                return _MISS
        if retry:
            self._answered_retry += 1
            return _RETRY
        self._answered_miss += 1
        return _MISS

    def _start_promotion(self, pos: int, key: BlockKey, request: RequestContext | None) -> bool:
        """Reserve a CPU row for ``key``, found in tier ``pos``, and queue its load for step end;
        False if no row can be freed."""
        slot = self.primary.reserve_one(key, self._protected() if self._hit_log else self._step_hits)
        if slot is None:
            self._stats.promotion_alloc_failures += 1
            return False
        last = self._last_promotion
        if last is not None and last[0] == pos and last[1] is request:
            pending, state = last[2], last[3]
        else:
            req_id = request.req_id if request else None
            found = self._pending_promotions.get((pos, req_id))
            if found is None:
                found = self._pending_promotions[(pos, req_id)] = _PendingPromotion(request)
            pending = found
            state = self._state(request)
            if state is not None:
                self._in_step(state)
            self._last_promotion = (pos, request, pending, state)
        pending.keys.append(key)
        pending.slots.append(slot)
        if state is not None:
            state.unsubmitted_promotions += 1
        self._stats.promotions_started += 1
        self.promoted_from = pos + 1
        return True

    def _protected(self) -> set[BlockKey]:
        """The keys no eviction may take now: those answered HIT this step."""
        log = self._hit_log
        if log:
            self._step_hits.update(log)
            log.clear()
        return self._step_hits

    def _in_step(self, state: _RequestState) -> None:
        """List ``state`` for this step's end (promotions to submit, cascades parked)."""
        if not state.in_step:
            state.in_step = True
            self._step_states.append(state)

    def prepare_load(self, keys: Sequence[BlockKey], request: RequestContext | None = None) -> np.ndarray:
        """Pin HIT blocks for a device load; returns their CPU rows. Raises if one is not HIT."""
        keys = self._open_keys("prepare_load", keys)
        self._poll_once()
        state = self._requests.get(request.req_id) if request is not None else None
        rows = self.primary.prepare_load(keys, after=state.chain_tail if state is not None else None)
        if state is not None and keys:
            state.chain_tail = keys[-1]
            state.stored_tail = False
        self._telemetry[0].read.add(len(keys), len(keys) * self.primary.block_bytes, 0.0)
        return rows

    def complete_load(self, keys: Iterable[BlockKey], request: RequestContext | None = None) -> None:
        self.primary.unpin(self._open_keys("complete_load", keys))

    def touch(self, keys: Sequence[BlockKey], request: RequestContext | None = None) -> None:
        """Recency for ``keys`` in every tier (also for blocks hit in the device cache)."""
        keys = self._open_keys("touch", keys)
        self.primary.touch(keys)
        for pos, tier in enumerate(self.tiers):
            if pos not in self._tiers_down:
                try:
                    tier.touch(keys, request)
                except Exception:
                    self._tier_call_failed(pos, "touch")

    # --- stores and cascades -----------------------------------------------------------

    def _state(self, request: RequestContext | None) -> _RequestState | None:
        if request is None:
            return None
        state = self._requests.get(request.req_id)
        if state is None:
            state = self._requests[request.req_id] = _RequestState(request, self._next_request_seq)
            self._next_request_seq += 1
        return state

    def prepare_store(
        self, keys: Sequence[BlockKey], request: RequestContext | None = None
    ) -> PrepareStoreResult | None:
        """Reserve CPU rows for a device -> CPU store; None if no room can be made."""
        keys = self._open_keys("prepare_store", keys)
        self._poll_once()
        if request is not None and not (request.control or self.request_control(request)).store:
            self._stats.stores_declined += len(keys)
            return PrepareStoreResult([], np.empty(0, dtype=np.int64), [])
        state = self._state(request)
        result = self.primary.prepare_store(
            keys, self._protected(), after=state.chain_tail if state else None,
            continues=state is not None and state.stored_tail,
        )  # fmt: skip
        if result is None:
            self._stats.store_rejections += 1
            return None
        if state is None:
            if keys:  # no request to continue it: the store is a whole request
                self.primary.end_request(keys[-1])
        else:
            if keys:
                state.chain_tail = keys[-1]
                state.stored_tail = True
            state.pending_store_keys.update(result.keys_to_store)
            if state.request_level_tiers:
                new = set(result.keys_to_store)
                present = [k for k in dict.fromkeys(keys) if k not in new]
                self._cascade_request_level(state, present)
        return result

    def _cascade_request_level(self, state: _RequestState, keys: list[BlockKey]) -> None:
        ready: list[BlockKey] = []
        for key in keys:
            ref = self.primary.ref_count(key)
            if ref is None:
                continue
            if ref < 0:
                state.parked_cascades.append(key)
                self._in_step(state)
            else:
                ready.append(key)
        if ready:
            self._cascade(ready, state.request_level_tiers, state.request)

    def complete_store(
        self, keys: Sequence[BlockKey], request: RequestContext | None = None, success: bool = True
    ) -> None:
        """The device -> CPU copy of ``keys`` finished; on success cascade them to every tier.

        Only rows that :meth:`prepare_store` reserved and nothing completed since are
        acted on (never a row a promotion is writing, nothing after a reset). The
        blocks are made readable and pinned for each tier they cascade to in one pass.
        """
        keys = self._open_keys("complete_store", keys)
        targets = self._cascade_targets(range(len(self.tiers)), request) if success else []
        done, slots = self.primary.complete_device_store(keys, success, len(targets))
        # A late completion (after reset, or after the request was finalized) must not
        # bring back a state that nothing would ever finish.
        state = self._requests.get(request.req_id) if request is not None else None
        if state is not None:
            state.pending_store_keys.difference_update(done)
        if targets and done:
            admitted = self._admit(targets, len(done))
            for _ in range(len(targets) - len(admitted)):
                self.primary.unpin(done)  # pinned for a tier under backpressure: released at once
            if admitted:
                self._submit_cascades(done, slots, admitted, request)
        if state is not None:
            self._maybe_finalize(state)

    def _cascade(self, keys: list[BlockKey], positions: Iterable[int], request: RequestContext | None) -> None:
        """Submit one store job of ``keys`` (ready blocks) to each tier at ``positions`` the
        request allows and that is not under backpressure."""
        targets = self._admit(self._cascade_targets(positions, request), len(keys))
        if targets:
            self._submit_cascades(keys, self.primary.pin_slots(keys, len(targets)), targets, request)

    def _cascade_targets(self, positions: Iterable[int], request: RequestContext | None) -> list[int]:
        """The tiers at ``positions`` that are up and that the request lets its blocks go to."""
        wanted = None if request is None else (request.control or self.request_control(request)).cascade_to
        down = self._tiers_down
        return [pos for pos in positions if pos not in down and (wanted is None or pos + 1 in wanted)]

    def _admit(self, targets: list[int], blocks: int) -> list[int]:
        """The tiers of ``targets`` whose backpressure admits a cascade of ``blocks`` blocks now
        (the others count it as skipped)."""
        admitted = []
        for pos in targets:
            monitor = self._pressure[pos]
            if monitor is not None and not monitor.admit(blocks, self._telemetry[pos + 1].stores_in_flight):
                self._stats.cascades_skipped += blocks
                continue
            admitted.append(pos)
        return admitted

    def _submit_cascades(
        self, keys: list[BlockKey], slots: list[int], targets: list[int], request: RequestContext | None
    ) -> None:
        """One store job per tier of ``targets``; the rows are pinned once for each already.
        The jobs share one read-only array of the rows (a tier reads ``job.slots``, never
        writes it). A tier that refuses its job releases its pin."""
        rows = np.array(slots, dtype=np.int64)
        rows.flags.writeable = False
        self._stats.cascade_jobs += len(targets)
        for pos in targets:
            # The tier gets its own copy of the keys: the job's record pairs the manager's with the rows.
            job = self._new_job(pos, keys, slots, rows, False, request, list(keys))
            telemetry = self._telemetry[pos + 1]
            telemetry.stores_in_flight += 1
            try:
                self.tiers[pos].submit_store(job)
            except Exception:
                logger.exception("secondary tier #%d failed to accept store job %d", pos + 1, job.job_id)
                self._stats.submit_errors += 1
                telemetry.stores_in_flight -= 1
                telemetry.fail("submit_error")
                del self._jobs[job.job_id]
                self.primary.unpin(keys)

    # --- requests and steps ---------------------------------------------------------------

    def on_new_request(self, request: RequestContext) -> OffloadPolicy:
        """REQUEST_LEVEL if any tier asks for it, else BLOCK_LEVEL."""
        if self._closing:
            self._refuse("on_new_request")
        self.request_control(request)
        state = self._state(request)
        assert state is not None
        state.request_level_tiers = []
        for pos, tier in enumerate(self.tiers):
            if pos in self._tiers_down:
                continue
            try:
                policy = tier.on_new_request(request)
            except Exception:
                self._tier_call_failed(pos, "on_new_request")
                continue
            if policy is OffloadPolicy.REQUEST_LEVEL:
                state.request_level_tiers.append(pos)
        return OffloadPolicy.REQUEST_LEVEL if state.request_level_tiers else OffloadPolicy.BLOCK_LEVEL

    def on_request_finished(self, request: RequestContext) -> None:
        """No more submit-side calls for ``request``; completions may still arrive."""
        if self._closing:
            self._refuse("on_request_finished")
        state = self._requests.get(request.req_id)
        if state is None:
            self._notify_finished(request)
            return
        state.finished = True
        if state.stored_tail and state.chain_tail is not None:
            self.primary.end_request(state.chain_tail)
        self._maybe_finalize(state)

    def _maybe_finalize(self, state: _RequestState) -> None:
        if (
            state.finished
            and not state.pending_store_keys
            and not state.parked_cascades
            and not state.unsubmitted_promotions
        ):
            del self._requests[state.request.req_id]
            self._notify_finished(state.request)

    def _notify_finished(self, request: RequestContext) -> None:
        for pos, tier in enumerate(self.tiers):
            if pos not in self._tiers_down:
                try:
                    tier.on_request_finished(request)
                except Exception:
                    self._tier_call_failed(pos, "on_request_finished")

    def on_schedule_end(self) -> None:
        """Once per engine step: poll, submit this step's promotions, flush parked cascades."""
        if self._closing:
            self._refuse("on_schedule_end")
        self._poll_once()
        if self._pending_promotions:
            self._submit_promotions()
        if self._step_states:
            self._end_step_of_requests()
        for pos, tier in self._step_end_tiers:
            try:
                tier.on_schedule_end()
            except Exception:
                self._tier_call_failed(pos, "on_schedule_end")
        for telemetry in self._telemetry:
            if len(telemetry.lookup_seconds.pending) >= telemetry.lookup_seconds.FOLD_AT:
                telemetry.lookup_seconds.fold()
        self._step_hits.clear()
        self._hit_log.clear()
        self._polled_this_step = self._steady = False

    def _tiers_with_step_end(self) -> list[tuple[int, SecondaryTier]]:
        """The live secondary tiers that do something in ``on_schedule_end`` (the base class's
        does nothing: a call per tier and step saved)."""
        base = SecondaryTier.on_schedule_end
        return [
            (pos, tier) for pos, tier, _, _ in self._secondary
            if getattr(getattr(tier, "on_schedule_end", None), "__func__", None) is not base
        ]  # fmt: skip

    def _submit_promotions(self) -> None:
        """Step end: one load job per (tier, request) of this step's promotions."""
        pending, self._pending_promotions = self._pending_promotions, {}
        self._last_promotion = None
        for (pos, _), promo in pending.items():
            rows = np.asarray(promo.slots, dtype=np.int64)
            job = self._new_job(pos, promo.keys, promo.slots, rows, True, promo.request)
            self._stats.promotion_jobs += 1
            telemetry = self._telemetry[pos + 1]
            telemetry.loads_in_flight += 1
            try:
                self.tiers[pos].submit_load(job)
            except Exception:
                logger.exception("secondary tier #%d failed to accept load job %d", pos + 1, job.job_id)
                self._stats.submit_errors += 1
                telemetry.loads_in_flight -= 1
                telemetry.fail("submit_error")
                del self._jobs[job.job_id]
                self.primary.complete_write(promo.keys, False)

    def _end_step_of_requests(self) -> None:
        """The step's end for the requests with promotions (just submitted) or parked cascades,
        in the order the requests came: flush what can go, finalize what is done."""
        states, self._step_states = self._step_states, []
        states.sort(key=_by_seq)
        for state in states:
            state.in_step = False
            state.unsubmitted_promotions = 0  # every promotion of this step was just submitted
            if state.parked_cascades:
                parked, state.parked_cascades = state.parked_cascades, []
                self._cascade_request_level(state, parked)  # lists the state again if still parked
            self._maybe_finalize(state)

    def has_pending_work(self) -> bool:
        """True while a tier job is in flight, a promotion awaits submission, or a cascade is parked."""
        if self._closing:
            self._refuse("has_pending_work")
        return bool(
            self._jobs
            or self._pending_promotions
            or any(s.parked_cascades for s in self._step_states)
            or any(self._tier_has_pending_work(pos) for pos in range(len(self.tiers)))
        )

    def _tier_has_pending_work(self, pos: int) -> bool:
        if pos in self._tiers_down:
            return False
        try:
            return self.tiers[pos].has_pending_work()
        except Exception:
            self._tier_call_failed(pos, "has_pending_work")
            return True  # keep the engine stepping so completions are still polled

    def take_events(self) -> list[BlockEvent]:
        """Stored/removed events of the CPU tier (unless built with ``events=False``) and every
        secondary tier since the last call."""
        if self._closing:
            self._refuse("take_events")
        events = self.primary.take_events()
        for pos, tier in enumerate(self.tiers):
            if pos not in self._tiers_down:
                try:
                    events.extend(tier.take_events())
                except Exception:
                    self._tier_call_failed(pos, "take_events")
        return events

    @property
    def is_idle(self) -> bool:
        """No request is known, no tier job is in flight and no promotion awaits submission."""
        return not (self._jobs or self._requests or self._pending_promotions)

    def jobs_in_flight(self) -> int:
        if self._closing:
            self._refuse("jobs_in_flight")
        return len(self._jobs)

    # --- reset -----------------------------------------------------------------------------

    def reset_cache(self, drain_timeout: float | None = None) -> None:
        """Drain every tier, consume completions, drop unsubmitted promotions, reset the CPU tier.

        Blocks until in-flight tier copies finish (never aborts one halfway).
        Persistent tiers keep their data. Raises :class:`TierError` (and resets
        nothing) if a tier cannot drain within the timeout.
        """
        if self._closing:
            self._refuse("reset_cache")
        timeout = self.drain_timeout if drain_timeout is None else drain_timeout
        for pos, tier in enumerate(self.tiers):
            if pos not in self._tiers_down:
                tier.drain(timeout)
        self._poll_all()
        if self._jobs:
            raise TierError(
                f"{len(self._jobs)} tier job(s) still unreported after drain; the CPU tier was not reset"
            )
        self._pending_promotions.clear()
        self._last_promotion = None
        self._step_states.clear()
        for state in list(self._requests.values()):
            state.pending_store_keys.clear()
            state.parked_cascades.clear()
            state.unsubmitted_promotions = 0
            state.in_step = False
            self._maybe_finalize(state)
        self.primary.reset()
        for telemetry in self._telemetry:
            telemetry.retry_since.clear()
        self._step_hits.clear()
        self._hit_log.clear()
        self._polled_this_step = self._steady = False

    # --- per-request control --------------------------------------------------------------

    def request_control(self, request: RequestContext) -> RequestControl:
        """What ``request`` allows (:mod:`kvtier.request_control`), parsed from its params once
        and kept in ``request.control``. Malformed keys are logged (once per distinct problem)
        and fall back to their defaults: a request is never refused for them."""
        control = request.control
        if control is None:
            params = request.params
            if not params or not any(key in params for key in CONTROL_KEYS):
                control = DEFAULT_CONTROL
            else:
                control, errors = parse_control(params, self._descriptors)
                for error in errors:
                    if error not in self._logged_control_errors and len(self._logged_control_errors) < 1024:
                        self._logged_control_errors.add(error)
                        logger.warning("request %s: %s; that setting is ignored", request.req_id, error)
            request.control = control
        return control

    def tier_descriptors(self) -> list[TierDescriptor]:
        """Index, label, type and locality of every tier, the CPU tier first (what request
        selectors match)."""
        return list(self._descriptors)

    # --- stats ---------------------------------------------------------------------------

    @property
    def telemetry(self) -> list[TierTelemetry]:
        """The manager's per-tier accumulators (index 0: CPU tier). Scheduler thread only; read
        :meth:`stats` instead unless you need raw samples (see ``LatencyHistogram.keep_samples``)."""
        return self._telemetry

    def stats(self) -> ManagerSnapshot:
        """A typed snapshot of the manager and every tier (:class:`~kvtier.telemetry.ManagerSnapshot`).

        Never raises because a tier misbehaves: a tier whose ``stats``,
        ``usage()`` or ``health()`` raises gets safe defaults (unknown usage,
        health ``unknown``), and the failure is counted (``call_error``) and logged
        once. May be called after shutdown. Cost: a few microseconds per tier plus
        each tier's ``usage()``/``health()``.
        """
        tiers = [self._cpu_snapshot()]
        tiers += [self._tier_snapshot(pos, tier) for pos, tier in enumerate(self.tiers)]
        counters = replace(
            self._stats, lookups=self._lookup_counts(), jobs_in_flight=len(self._jobs),
            active_requests=len(self._requests),
        )  # fmt: skip
        return ManagerSnapshot(
            taken_at=time.monotonic(),
            block_bytes=self.primary.block_bytes,
            row_stride=self.primary.region.row_stride,
            cpu_blocks=self.primary.num_blocks,
            manager=counters,
            tiers=tuple(tiers),
        )

    def _cpu_hits(self) -> int:
        """HITs the manager answered (each one a CPU hit): see the counting note in ``__init__``."""
        return self._counted - self._countdown - self._cpu_pending - self._cpu_misses

    def _lookup_counts(self) -> dict[str, int]:
        return {
            _HIT.value: self._cpu_hits(),
            _HIT_PENDING.value: self._answered_pending,
            _RETRY.value: self._answered_retry,
            _MISS.value: self._answered_miss,
        }

    def _cpu_snapshot(self) -> TierSnapshot:
        primary = self.primary
        own = primary.stats  # its own lookup() calls; the manager's lookups are added
        ps = replace(
            own, hits=own.hits + self._cpu_hits(), hits_pending=own.hits_pending + self._cpu_pending,
            misses=own.misses + self._cpu_misses,
        )  # fmt: skip
        telemetry = self._telemetry[0]
        stride = primary.region.row_stride
        return TierSnapshot(
            index=0,
            label=PRIMARY_LABEL,
            tier_type="primary",
            medium=primary.medium,
            locality="local",
            implementation=type(primary).__qualname__,
            lookups=LookupCounts(hit=ps.hits, hit_pending=ps.hits_pending, miss=ps.misses),
            lookup_seconds=telemetry.lookup_seconds.snapshot(),
            lookup_async_seconds=telemetry.lookup_async_seconds.snapshot(),
            written=TransferTotals(blocks=ps.blocks_stored, bytes=ps.blocks_stored * primary.block_bytes),
            read=TransferTotals(**asdict(telemetry.read)),
            failures={
                "store_failed": ps.store_failures,
                "store_rejected": ps.store_rejections,
                "promotion_alloc_failed": self._stats.promotion_alloc_failures,
            },
            stores_in_flight=0,
            loads_in_flight=0,
            used_bytes=len(primary) * stride,
            capacity_bytes=primary.num_blocks * stride,
            entries=len(primary),
            evictions=ps.evictions,
            health="closed" if not self._shutdown_complete else "down",
            counters=asdict(ps),
            policy=PolicySnapshot.of(primary.policy),
        )

    def _tier_snapshot(self, pos: int, tier: SecondaryTier) -> TierSnapshot:
        """One secondary tier's snapshot; whatever the tier fails to give gets a safe default
        (the failure is counted and logged once), so ``stats()`` never raises."""
        counters: dict[str, Any] = {}
        extra: dict[str, float] = {}
        kinds: dict[str, str] = {}
        try:
            own = tier.stats
            counters = {f.name: getattr(own, f.name) for f in fields(own) if f.name != "extra"}
            extra = {str(k): float(v) for k, v in own.extra.items()}
            declared = getattr(tier, "extra_metrics", {})
            kinds = {name: getattr(declared.get(name), "kind", "gauge") for name in extra}
        except Exception:
            self._tier_call_failed(pos, "stats")
        used = capacity = entries = None
        health = "down"
        if pos not in self._tiers_down:
            try:
                usage = tier.usage()
                used, capacity, entries = usage.used_bytes, usage.capacity_bytes, usage.entries
            except Exception:
                self._tier_call_failed(pos, "usage")
            try:
                health = tier.health().state.value
            except Exception:
                health = "unknown"
                self._tier_call_failed(pos, "health")
        telemetry = self._telemetry[pos + 1]
        failures = dict(telemetry.failures)
        for kind, name in (("store_failed", "stores_failed"), ("load_failed", "loads_failed"),
                           ("store_dropped", "stores_dropped"), ("corrupt_value", "corrupt_values")):
            failures[kind] = int(counters.get(name, 0))
        monitor = self._pressure[pos]
        descriptor = self._descriptors[pos + 1]
        return TierSnapshot(
            index=pos + 1,
            label=descriptor.label,
            tier_type=descriptor.tier_type,
            medium=str(getattr(tier, "medium", "storage")),
            locality=descriptor.locality,
            implementation=type(tier).__qualname__,
            lookups=LookupCounts(
                hit=int(counters.get("lookups_hit", 0)),
                retry=int(counters.get("lookups_retry", 0)),
                miss=int(counters.get("lookups_miss", 0)),
            ),
            lookup_seconds=telemetry.lookup_seconds.snapshot(),
            lookup_async_seconds=telemetry.lookup_async_seconds.snapshot(),
            written=TransferTotals(**asdict(telemetry.written)),
            read=TransferTotals(**asdict(telemetry.read)),
            failures=failures,
            stores_in_flight=telemetry.stores_in_flight,
            loads_in_flight=telemetry.loads_in_flight,
            used_bytes=used,
            capacity_bytes=capacity,
            entries=entries,
            evictions=int(counters.get("evictions", 0)),
            health=health,
            backpressure=None if monitor is None else monitor.snapshot(),
            counters=counters,
            extra=extra,
            extra_kinds=kinds,
        )

    # --- shutdown --------------------------------------------------------------------------

    def shutdown(self, timeout: float | None = None) -> None:
        """Shut down every secondary tier, then (only if all succeeded) the CPU tier.

        Every tier is attempted even after earlier ones fail; each failure is
        logged with the tier's index, type and class. If any failed, the CPU tier
        and its shared mapping are left intact (a failed tier may still be using
        the rows) and :class:`TierShutdownError` is raised, carrying every failure
        and chained to the last one. Calling again retries only the failed tiers,
        then releases the CPU tier. After a complete shutdown this is a no-op.
        KeyboardInterrupt and SystemExit propagate at once and never lead to the
        CPU tier being released.

        Deadline: ``timeout`` seconds (default: ``shutdown_timeout`` of the
        constructor; None there means no deadline) for all tiers together. Each
        tier's ``shutdown()`` then runs on its own thread and is waited for at
        most its share (the time left divided by the tiers left); a tier that
        overruns is abandoned and fails with :class:`TierShutdownTimeout`, and the
        next tiers are still attempted. A retry waits again for a tier still
        running its earlier ``shutdown()`` instead of calling it twice.
        """
        if self._shutdown_complete:
            return
        self._closing = True
        self._steady = False
        limit = self.shutdown_timeout if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + max(0.0, limit)
        pending = [pos for pos in range(len(self.tiers)) if pos not in self._tiers_down]
        failures: list[TierFailure] = []
        for done, pos in enumerate(pending):
            tier = self.tiers[pos]
            share = None if deadline is None else max(0.0, deadline - time.monotonic()) / (len(pending) - done)
            error = self._shutdown_tier(pos, tier, share)
            if error is None:
                self._tiers_down.add(pos)
                self._secondary = [entry for entry in self._secondary if entry[0] != pos]
                self._step_end_tiers = self._tiers_with_step_end()
                tier.context.release_rows()
                continue
            logger.error(
                "Failed to shut down secondary tier #%d (type=%s, class=%s): %s",
                pos + 1, tier.tier_type, type(tier).__qualname__, error, exc_info=error,
            )
            failures.append(TierFailure(pos + 1, tier.tier_type, type(tier).__qualname__, error))
        if failures:
            raise TierShutdownError(failures) from failures[-1].error
        self._jobs.clear()
        for telemetry in self._telemetry:  # every tier stopped: no job of theirs is in flight
            telemetry.stores_in_flight = telemetry.loads_in_flight = 0
        self._pending_promotions.clear()
        self._last_promotion = None
        self.primary.shutdown()
        self._shutdown_complete = True

    def _shutdown_tier(self, pos: int, tier: SecondaryTier, share: float | None) -> Exception | None:
        """Run (or keep waiting for) one tier's ``shutdown()``; its error, or None on success.

        Without a deadline, and with no earlier call still running, the call is made
        in this thread. KeyboardInterrupt/SystemExit raised by the tier propagate.
        """
        run = self._shutdown_runs.get(pos)
        if share is None and run is None:
            try:
                tier.shutdown()
            except Exception as exc:
                return exc
            return None
        if run is None:
            run = self._shutdown_runs[pos] = _ShutdownRun(tier, pos)
            still = ""
        else:
            still = " (still running the shutdown() of an earlier attempt)"
        if not run.wait(share):
            return TierShutdownTimeout(
                f"secondary tier #{pos + 1} (type={tier.tier_type}) did not finish shutdown() within its "
                f"{share:.3g}s share of the deadline{still}; abandoned while still running, so the CPU "
                "tier stays mapped. Call shutdown() again to wait for it"
            )
        del self._shutdown_runs[pos]
        if run.error is None or isinstance(run.error, Exception):
            return run.error
        raise run.error  # KeyboardInterrupt / SystemExit inside the tier: stop here

    @property
    def is_shut_down(self) -> bool:
        return self._shutdown_complete

    def __enter__(self) -> TieringManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


__all__ = ["ManagerStats", "TieringManager"]
