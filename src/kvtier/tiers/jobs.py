"""The tier platform: the machinery every asynchronous secondary tier shares.

A backend built on :class:`ThreadedTier` supplies its lookup and its I/O and
nothing else; this module owns the rest of the :mod:`~kvtier.tiers.base`
contract:

* **Jobs.** ``submit_store``/``submit_load`` register each
  :class:`~kvtier.tiers.base.TransferJob` by its id (a duplicate id in flight
  is refused), split it into :class:`Work` items (one per block by default),
  queue them, and report one :class:`~kvtier.tiers.base.JobResult` per job
  (with per-key partial success) through ``poll_finished``, exactly once.
* **Queues.** One :class:`WorkQueue` with lanes served in priority order:
  existence checks, then loads, then stores, then background work. Stores are
  shed (dropped and counted) while the tier is out of service or more than
  ``max_queued_stores`` store items wait, so a slow medium loses writes before
  reads suffer. A job may carry a deadline; work still queued past it fails
  without touching the medium.
* **Threads.** Worker threads per lane set (e.g. read-only threads beside
  read/write threads), a per-thread resource hook, periodic housekeeping, and
  on ``shutdown`` a bounded grace period, failure of what is still queued,
  joining with a timeout, and release of the CPU rows only once every thread
  is proven stopped.
* **Health.** A :class:`~kvtier.tiers.health.CircuitBreaker`: while it is open
  lookups answer MISS, stores are dropped and loads fail at once; a worker runs
  the tier's :meth:`ThreadedTier._probe` when the breaker is half-open.
* **Events and counters.** Stored/removed events for ``take_events``;
  :class:`~kvtier.tiers.base.TierStats` kept consistent across threads.

A backend implements (all but the first are optional):

``_run(work, local)``
    On an I/O thread: move the bytes of one :class:`Work` item and report it
    with :meth:`ThreadedTier._complete` (or, for a tier that builds whole-job
    results itself, :meth:`ThreadedTier._finish`). May block on its medium,
    bounded by the tier's timeouts.
``_lookup(key, request)``
    On the scheduler thread, from memory: HIT, MISS or RETRY. The base has
    already answered MISS when the tier is shut down or out of service, and
    counts the answer.
``_holds(key)``, ``_admit_load(key)``, ``_plan_store``, ``_plan_load``
    On the scheduler thread: skip keys already held, reserve keys to load
    (e.g. pin them against eviction), batch blocks into work items.
``_abandon(work)``
    Undo what ``_admit_load``/``_plan_*`` reserved for work that will never run.
``_probe()``, ``_housekeeping()``, ``_open_worker()``/``_close_worker()``, ``_stop()``, ``_close()``
    Health probe, periodic upkeep and per-thread resources on I/O threads;
    shutdown hooks.

:mod:`kvtier.tiers.memory` is the smallest complete example.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kvtier.errors import TierDrainTimeout, TierError
from kvtier.failures import describe_error, ends_thread, forget_frames, is_native_crash, log_failure
from kvtier.keys import BlockKey
from kvtier.tiers.base import (
    ExtraMetric,
    HealthState,
    JobResult,
    SecondaryTier,
    TierContext,
    TierHealth,
    TransferJob,
)
from kvtier.tiers.doubts import WritesInDoubt
from kvtier.tiers.health import CircuitBreaker
from kvtier.types import BlockEvent, LookupResult, RequestContext

logger = logging.getLogger(__name__)

_MAX_ERRORS_PER_JOB = 8
_IDLE_WAIT = 5.0  # seconds an idle worker that keeps no time sleeps between checks of the queue


class Lane(enum.IntEnum):
    """Queues of work, served in this order (lower first) by every thread that serves them."""

    EXISTS = 0
    """Existence checks: lookups of the engine are waiting (answered RETRY meanwhile)."""
    LOAD = 1
    """Promotions into reserved CPU rows: a request is waiting."""
    STORE = 2
    """Cascades from pinned CPU rows: nobody waits; shed first when the medium is slow."""
    BACKGROUND = 3
    """Best-effort upkeep (TTL refresh, warm-start listing)."""


ALL_LANES: frozenset[Lane] = frozenset(Lane)
READ_LANES: frozenset[Lane] = frozenset({Lane.EXISTS, Lane.LOAD})


@dataclass(eq=False)
class JobState:
    """Book-keeping of one submitted job while its work items are in flight.

    Written under the tier's lock only. ``remaining`` counts work items not yet
    reported (plus one while the job is being dispatched).
    """

    job: TransferJob
    started: float
    deadline: float | None
    remaining: int = 1
    ok: set[BlockKey] = field(default_factory=set)
    bytes_moved: int = 0
    errors: list[str] = field(default_factory=list)
    finished: bool = False

    @property
    def is_load(self) -> bool:
        return self.job.is_promotion

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


@dataclass(eq=False)
class Work:
    """One unit of I/O: some blocks of a job (``job`` set) or tier-internal work (``job`` None).

    ``keys[i]`` goes to or comes from CPU row ``slots[i]``. ``payload`` is free
    for the backend (e.g. a flag saying the key was pinned).
    """

    lane: Lane
    job: JobState | None = None
    keys: list[BlockKey] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    payload: Any = None
    done: bool = False


class WorkQueue:
    """Lanes of :class:`Work`, taken in lane order by threads that each serve a set of lanes.

    Threads serving the same lane set wait on one condition, so a put wakes
    only threads that can take the new work. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lanes: dict[Lane, deque[Work]] = {lane: deque() for lane in Lane}
        self._waiters: dict[frozenset[Lane], threading.Condition] = {}
        self._closed = False

    def serve(self, lanes: frozenset[Lane]) -> None:
        """Declare a lane set some thread will :meth:`get` with (before it does)."""
        with self._lock:
            self._waiters.setdefault(lanes, threading.Condition(self._lock))

    def put(self, works: Sequence[Work]) -> None:
        if not works:
            return
        with self._lock:
            if self._closed:
                raise TierError("work queue is closed")
            counts: dict[Lane, int] = {}
            for work in works:
                self._lanes[work.lane].append(work)
                counts[work.lane] = counts.get(work.lane, 0) + 1
            for lanes, cond in self._waiters.items():
                n = sum(c for lane, c in counts.items() if lane in lanes)
                if n:
                    cond.notify(n)

    def get(self, lanes: frozenset[Lane], timeout: float) -> Work | None:
        """The next work of ``lanes`` (lowest lane first, FIFO within a lane).

        Waits up to ``timeout`` seconds; None on timeout or once closed.
        """
        with self._lock:
            cond = self._waiters.get(lanes)
            if cond is None:  # (not setdefault: that would build a Condition on every call)
                cond = self._waiters[lanes] = threading.Condition(self._lock)
            for attempt in range(2):
                if self._closed:
                    return None
                for lane in sorted(lanes):
                    queue = self._lanes[lane]
                    if queue:
                        return queue.popleft()
                if attempt == 0:
                    cond.wait(timeout)
            return None

    def queued(self, lane: Lane) -> int:
        return len(self._lanes[lane])

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> list[Work]:
        """Stop handing out work; wakes every waiting thread; returns the work still queued."""
        with self._lock:
            self._closed = True
            left = [w for lane in Lane for w in self._lanes[lane]]
            for queue in self._lanes.values():
                queue.clear()
            for cond in self._waiters.values():
                cond.notify_all()
            return left


class ThreadedTier(SecondaryTier):
    """A secondary tier whose bytes move on its own worker threads; see the module docstring.

    Construction: a subclass calls ``super().__init__`` with its breaker and
    queue limits, sets up its medium, then starts its threads with
    :meth:`_start_workers` (and :meth:`_start_thread` for anything else). If
    its constructor fails after threads started, it calls
    :meth:`_shut_after_failed_start` before re-raising.

    Options shared by every tier on this platform (validated by the subclass's
    options model): ``max_queued_stores`` (store work items allowed to wait;
    beyond that stores are shed), ``shutdown_timeout`` (seconds to wait for each
    thread on shutdown) and ``shutdown_grace`` (seconds queued jobs may keep
    running at shutdown before the rest are failed), ``job_timeout`` (seconds
    after submission when still-queued work of a job fails; None: no deadline).
    """

    extra_metrics: ClassVar[Mapping[str, ExtraMetric]] = {
        "stores_skipped": ExtraMetric("counter", "Blocks of store jobs the tier already held (nothing written)."),
        "stores_shed_queue_full": ExtraMetric(
            "counter", "Blocks of store jobs shed because the write queue was full (of store_dropped)."
        ),
    }
    """Kept by every tier on this platform; a subclass declaring its own extends these
    (``{**ThreadedTier.extra_metrics, ...}``)."""

    housekeeping_interval: float = 0.1
    """The first worker thread wakes this often while idle to run probes and :meth:`_housekeeping`
    (every worker also runs them after each work item, when no other thread is)."""

    def __init__(
        self,
        context: TierContext,
        *,
        breaker: CircuitBreaker,
        max_queued_stores: int,
        shutdown_timeout: float,
        shutdown_grace: float = 0.0,
        job_timeout: float | None = None,
    ) -> None:
        super().__init__(context)
        if context.block_bytes <= 0:
            raise TierError(f"block_bytes must be > 0, got {context.block_bytes}")
        self.max_queued_stores = int(max_queued_stores)
        self.shutdown_timeout = float(shutdown_timeout)
        self.shutdown_grace = float(shutdown_grace)
        self.job_timeout = job_timeout
        self._breaker = breaker
        self._rows: np.ndarray | None = context.rows
        self._block_bytes = context.block_bytes

        self._lock = threading.Lock()  # jobs, results, events
        self._idle = threading.Condition(self._lock)
        self._stats_lock = threading.Lock()  # TierStats written by several threads
        self._active: dict[int, JobState] = {}
        # Existence checks in flight (key -> when queued), for tiers that answer RETRY; under _lock.
        self._checking: dict[BlockKey, float] = {}
        self._results: list[JobResult] = []
        self._events: list[BlockEvent] = []
        self._queue = WorkQueue()
        self._threads: list[threading.Thread] = []
        self._has_keeper = False
        self._stopping = threading.Event()
        self._probe_lock = threading.Lock()
        self._house_lock = threading.Lock()
        self._closed = False  # scheduler thread: no more submits
        self._shut = False
        self.stats.extra.setdefault("stores_skipped", 0)
        self.stats.extra.setdefault("stores_shed_queue_full", 0)  # of stores_dropped: the write queue was full

    # --- threads ---------------------------------------------------------------------------

    def _start_workers(self, count: int, lanes: frozenset[Lane], role: str) -> None:
        """Start ``count`` worker threads that serve ``lanes``."""
        self._queue.serve(lanes)
        for i in range(count):
            # The first worker of the tier keeps time (probes, housekeeping) while idle; the
            # others sleep until work comes, so an idle tier costs one wake-up per interval.
            keeper = not self._has_keeper
            self._has_keeper = True
            self._start_thread(f"{role}-{i}", self._worker_loop, lanes, keeper)

    def _shut_after_failed_start(self) -> None:
        """A constructor failed after threads started: :meth:`shutdown` (joins them); a failure of
        that is logged, and the constructor re-raises its own error."""
        try:
            self.shutdown()
        except Exception as exc:
            what = f"{self.tier_type} tier {self.label}: not shut down after a failed start"
            log_failure(logger, logging.ERROR, what, exc)

    def _start_thread(self, role: str, target: Callable[..., None], *args: Any) -> None:
        """Start an owned daemon thread; :meth:`shutdown` joins it (``target`` must watch ``_stopping``)."""
        name = f"kvtier-{self.tier_type}-{self.context.index}-{role}"
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _worker_loop(self, lanes: frozenset[Lane], keeper: bool) -> None:
        local = self._open_worker()
        wait = self.housekeeping_interval if keeper else _IDLE_WAIT
        try:
            while True:
                work = self._queue.get(lanes, wait)
                if self._queue.closed and work is None:
                    return
                self._tick()
                if work is not None:
                    self._execute(work, local)
                elif not self._stopping.is_set():
                    self._upkeep(self._idle_upkeep)
        finally:
            self._close_worker(local)

    def _execute(self, work: Work, local: Any) -> None:
        state = work.job
        if state is not None and state.expired(time.monotonic()):
            self._abandon(work)
            self._complete(
                work, error=f"job deadline of {self.job_timeout}s passed before the work ran", dropped=not state.is_load
            )
            return
        try:
            self._run(work, local)
        except BaseException as exc:  # a bug or a crash of a native client fails the job, not the thread
            lane = work.lane.name.lower()
            detail = log_failure(
                logger, logging.ERROR, f"{self.tier_type} tier {self.label}: unexpected error in {lane} work", exc,
                with_traceback=True,
            )  # fmt: skip
            if is_native_crash(exc):  # its client may be in any state: out of service until a probe passes
                self._note_failure(detail, trip=True)
            if state is not None and not work.done and not state.finished:
                self._complete(work, error=f"internal error: {detail}")
            if ends_thread(exc):
                raise

    def _tick(self) -> None:
        """Probe when the breaker is half-open, then run housekeeping (one thread at a time)."""
        if self._stopping.is_set():
            return
        if self._breaker.probe_due() and self._probe_lock.acquire(blocking=False):
            try:
                if self._breaker.probe_due():
                    self._run_probe()
            finally:
                self._probe_lock.release()
        self._upkeep(self._housekeeping)

    def _upkeep(self, step: Callable[[], None]) -> None:
        """Run :meth:`_housekeeping` or :meth:`_idle_upkeep` unless another thread runs one; a
        failure is logged (a native client's crash takes the tier out of service), never raised."""
        if self._house_lock.acquire(blocking=False):
            try:
                step()
            except BaseException as exc:
                if ends_thread(exc):
                    raise
                what = f"{self.tier_type} tier {self.label}: housekeeping failed"
                detail = log_failure(logger, logging.WARNING, what, exc)
                if is_native_crash(exc):
                    self._note_failure(detail, trip=True)
            finally:
                self._house_lock.release()

    def _run_probe(self) -> None:
        try:
            self._probe()
        except BaseException as exc:
            if ends_thread(exc):
                raise
            detail = log_failure(logger, logging.DEBUG, f"{self.tier_type} tier {self.label}: probe failed", exc)
            self._breaker.record_failure(f"health probe failed: {detail}")
        else:
            self._breaker.record_success()
            logger.info("%s tier %s back in service", self.tier_type, self.label)

    # --- hooks for backends ------------------------------------------------------------------

    def _run(self, work: Work, local: Any) -> None:
        """Move the bytes of ``work`` and report it (I/O thread). See the module docstring."""
        raise NotImplementedError

    def _lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        """HIT, MISS or RETRY from memory (scheduler thread); the base gates and counts."""
        raise NotImplementedError

    def _holds(self, key: BlockKey) -> bool:
        """True if a store of ``key`` can be skipped (already held). Scheduler thread."""
        return False

    def _admit_load(self, key: BlockKey) -> bool:
        """Reserve ``key`` for a load (e.g. pin it); False if it is not held. Scheduler thread."""
        return True

    def _unverify_locked(self, keys: Iterable[BlockKey]) -> None:
        """The loads of ``keys`` failed: a tier that answers lookups from a cache of existence
        checks drops its positive answers for them, so it checks again (and answers RETRY
        meanwhile) before it promises them again. Called with ``_lock`` held, on the thread that
        reports the job; the default keeps nothing to drop."""

    def _plan_store(self, state: JobState, blocks: list[tuple[BlockKey, int]]) -> list[Work]:
        """Work items for the ``(key, slot)`` blocks to store; default one per block."""
        return [Work(Lane.STORE, state, [key], [slot]) for key, slot in blocks]

    def _plan_load(self, state: JobState, blocks: list[tuple[BlockKey, int]]) -> list[Work]:
        """Work items for the ``(key, slot)`` blocks to load; default one per block."""
        return [Work(Lane.LOAD, state, [key], [slot]) for key, slot in blocks]

    def _abandon(self, work: Work) -> None:
        """Undo reservations of ``work``, which will not run (shut down or deadline passed)."""

    def _probe(self) -> None:
        """Check the medium while the breaker is half-open (I/O thread); raise if it still fails."""

    def _housekeeping(self) -> None:
        """Periodic upkeep on an I/O thread (one at a time); must be bounded by the tier's timeouts."""

    _doubts: WritesInDoubt | None = None
    """A tier that keeps writes whose outcome is unknown (:mod:`kvtier.tiers.doubts`) sets it and
    implements :meth:`_settle_doubts`."""

    def _keep_doubts(self, limit: int, settle_after: float) -> WritesInDoubt:
        """Writes in doubt for a tier that keeps them (sets :attr:`_doubts` to this), with their
        number in the ``writes_in_doubt`` gauge (:data:`~kvtier.tiers.base.WRITES_IN_DOUBT_METRIC`)."""
        extra = self.stats.extra
        extra["writes_in_doubt"] = 0.0  # (exported as 0 from the start, not only once a write was in doubt)

        def gauge(n: int) -> None:
            extra["writes_in_doubt"] = float(n)

        return WritesInDoubt(limit, settle_after, on_size=gauge)

    def _idle_upkeep(self) -> None:
        """Upkeep that may wait on the medium, run only by a worker that found no work (one at a
        time with :meth:`_housekeeping`; :meth:`_tick` runs with a work item already taken, which
        would wait as long): writes in doubt are checked, ``idle`` if no work is queued either.
        Must be bounded by the tier's timeouts; a failure is logged."""
        if self._doubts and self._breaker.serving:
            self._settle_doubts(idle=self._queue_idle())

    def _settle_doubts(self, idle: bool) -> None:
        """Check writes in doubt (a tier that sets :attr:`_doubts`); ``idle``: called by a worker
        with no work in hand and none queued. I/O thread, one at a time with :meth:`_housekeeping`."""

    def _open_worker(self) -> Any:
        """Per-thread resources, handed to every ``_run`` of that thread."""
        return None

    def _close_worker(self, local: Any) -> None:
        """Release what :meth:`_open_worker` returned."""

    def _stop(self) -> None:
        """Shutdown: after the queue closed, before threads are joined (e.g. stop a scan)."""

    def _close(self) -> None:
        """Shutdown: after every thread stopped, release the medium (connections, files)."""

    def _join_timeout(self) -> float:
        """Seconds :meth:`shutdown` waits for the threads in all."""
        return self.shutdown_timeout

    # --- helpers for backends ----------------------------------------------------------------

    def _row(self, slot: int, nbytes: int | None = None) -> memoryview:
        """A writable view of the first ``nbytes`` (default: the block) of CPU row ``slot``."""
        rows = self._rows
        if rows is None:
            raise TierError(f"{self.tier_type} tier {self.label}: CPU rows were released")
        return rows[slot, : self._block_bytes if nbytes is None else nbytes].data

    def _count(self, **increments: float) -> None:
        """Add to :class:`TierStats` fields (or ``stats.extra`` entries) from any thread."""
        with self._stats_lock:
            stats = self.stats
            for name, n in increments.items():
                if hasattr(stats, name):
                    setattr(stats, name, getattr(stats, name) + n)
                else:
                    stats.extra[name] = stats.extra.get(name, 0) + n

    def _queue_idle(self) -> bool:
        """No work waits in the queue (work may still be running). Any thread."""
        return not any(self._queue.queued(lane) for lane in Lane)

    def _announce_found(self, keys: list[BlockKey]) -> None:
        """Blocks whose writes failed with their outcome unknown (:mod:`kvtier.tiers.doubts`)
        that a check, lookup or load found in the store: counted (``uploads_found``) and
        announced stored. Any I/O thread; the caller holds no lock."""
        if keys:
            self._count(uploads_found=len(keys))
            self._emit(keys, removed=False)

    def _emit(self, keys: Iterable[BlockKey], removed: bool, when: float | None = None) -> None:
        """Queue a stored (or removed) event for ``keys`` that happened at ``when`` (default:
        now). A shared store's events from several engines are ordered by these times: time a
        store after its value became visible, a removal before it started."""
        keys = tuple(keys)
        if keys:
            event = BlockEvent(keys, self.label, self.medium, removed, time.time() if when is None else when)
            with self._lock:
                self._events.append(event)

    def _note_failure(self, detail: str, trip: bool = False) -> None:
        """Feed a medium failure to the breaker (``trip``: open at once); logs going out of service."""
        before = self._breaker.state
        if trip:
            self._breaker.trip(detail)
        else:
            self._breaker.record_failure(detail)
        if before is not HealthState.OPEN and self._breaker.state is HealthState.OPEN:
            logger.warning("%s tier %s out of service: %s", self.tier_type, self.label, detail)

    def _complete(
        self,
        work: Work,
        ok: Iterable[BlockKey] = (),
        nbytes: int = 0,
        error: str | None = None,
        dropped: bool = False,
    ) -> None:
        """Report one work item: the keys of it that succeeded, the bytes moved, why the others failed.

        Counts bytes and failures (as dropped when ``dropped``) in the stats and
        reports the job once its last item is in. Call exactly once per item.
        """
        state = work.job
        if state is None or work.done:
            return
        ok_keys = set(ok)
        failed = len(set(work.keys) - ok_keys)
        if state.is_load:
            self._count(bytes_read=nbytes, loads_failed=failed)
        elif dropped:
            self._count(bytes_written=nbytes, stores_dropped=failed)
        else:
            self._count(bytes_written=nbytes, stores_failed=failed)
        with self._lock:
            work.done = True
            state.ok |= ok_keys
            state.bytes_moved += nbytes
            if failed and error and len(state.errors) < _MAX_ERRORS_PER_JOB and error not in state.errors:
                state.errors.append(error)
            state.remaining -= 1
            if state.remaining == 0:
                self._report_locked(state)

    def _report_locked(self, state: JobState) -> None:
        job = state.job
        seconds = time.perf_counter() - state.started
        all_ok = state.ok >= set(job.keys)
        result = JobResult(
            job_id=job.job_id,
            success=all_ok,
            successful_keys=None if all_ok else frozenset(state.ok),
            bytes_moved=state.bytes_moved,
            seconds=seconds,
            error=None if all_ok else ("; ".join(state.errors) or "failed"),
        )
        with self._stats_lock:
            if job.is_promotion:
                self.stats.seconds_reading += seconds
            else:
                self.stats.seconds_writing += seconds
        self._finish_locked(result)

    def _finish(self, result: JobResult) -> None:
        """Report a whole job with a result the backend built itself (it also kept the stats)."""
        with self._lock:
            self._finish_locked(result)

    def _finish_locked(self, result: JobResult) -> None:
        state = self._active.pop(result.job_id, None)
        if state is None:
            logger.error("%s tier %s: job %d reported twice; ignored", self.tier_type, self.label, result.job_id)
            return
        state.finished = True
        if state.is_load and not result.success:
            ok = result.successful_keys or frozenset()
            self._unverify_locked([key for key in state.job.keys if key not in ok])
        self._results.append(result)
        if not self._active:
            self._idle.notify_all()

    # --- scheduler-thread calls ----------------------------------------------------------------

    def lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        """MISS at once when shut down or out of service; else the backend's :meth:`_lookup`, counted."""
        answer = LookupResult.MISS if self._closed or not self._breaker.serving else self._lookup(key, request)
        stats = self.stats
        if answer is LookupResult.HIT:
            stats.lookups_hit += 1
        elif answer is LookupResult.RETRY:
            stats.lookups_retry += 1
        else:
            stats.lookups_miss += 1
        return answer

    def submit_store(self, job: TransferJob) -> None:
        """Queue the blocks of ``job`` not already held; shed them while out of service or backed up."""
        state = self._begin(job)
        todo: list[tuple[BlockKey, int]] = []
        skipped = 0
        for key, slot in zip(job.keys, job.slots, strict=True):
            if self._holds(key):
                state.ok.add(key)
                skipped += 1
            else:
                todo.append((key, int(slot)))
        works: list[Work] = []
        dropped = shed = 0
        if todo:
            reason = None
            if not self._breaker.serving:
                reason = "tier out of service"
            elif self._queue.queued(Lane.STORE) >= self.max_queued_stores:
                reason, shed = "write queue full", len(todo)
            if reason is None:
                works = self._plan_store(state, todo)
            else:
                dropped = len(todo)
                state.errors.append(f"{dropped} block(s) dropped: {reason}")
        self._count(stores_submitted=len(job.keys), stores_skipped=skipped, stores_dropped=dropped,
                    stores_shed_queue_full=shed)  # fmt: skip
        self._dispatch(state, works)

    def submit_load(self, job: TransferJob) -> None:
        """Queue the loads of ``job`` into its reserved rows; fails at once while out of service."""
        state = self._begin(job)
        todo: list[tuple[BlockKey, int]] = []
        missing = 0
        serving = self._breaker.serving
        for key, slot in zip(job.keys, job.slots, strict=True):
            if serving and self._admit_load(key):
                todo.append((key, int(slot)))
            else:
                missing += 1
        if missing:
            state.errors.append(
                f"{missing} block(s) no longer held" if serving else f"{self.tier_type} tier is out of service"
            )
        self._count(loads_submitted=len(job.keys), loads_failed=missing)
        self._dispatch(state, self._plan_load(state, todo) if todo else [])

    def _begin(self, job: TransferJob) -> JobState:
        if self._closed:
            raise TierError(f"{self.tier_type} tier {self.label} is shut down; it accepts no more jobs")
        if len(job.keys) != len(job.slots):
            raise TierError(f"job {job.job_id} has {len(job.keys)} keys but {len(job.slots)} slots")
        deadline = None if self.job_timeout is None else time.monotonic() + self.job_timeout
        state = JobState(job, time.perf_counter(), deadline)
        with self._lock:
            if job.job_id in self._active:
                raise TierError(f"{self.tier_type} tier {self.label}: job id {job.job_id} is already in flight")
            self._active[job.job_id] = state
        return state

    def _dispatch(self, state: JobState, works: list[Work]) -> None:
        """Queue ``works`` of ``state`` and drop the dispatch placeholder (may report the job)."""
        with self._lock:
            state.remaining += len(works)
        try:
            self._queue.put(works)
        except TierError:
            for work in works:
                self._abandon(work)
                self._complete(work, error="tier shut down before the work ran", dropped=not state.is_load)
        with self._lock:
            state.remaining -= 1
            if state.remaining == 0:
                self._report_locked(state)

    def _queue_internal(self, work: Work) -> bool:
        """Queue tier-internal work (``work.job`` None); False if the queue is closed."""
        try:
            self._queue.put([work])
        except TierError:
            return False
        return True

    def poll_finished(self) -> list[JobResult]:
        with self._lock:
            done, self._results = self._results, []
        return done

    def has_pending_work(self) -> bool:
        """True while jobs are in flight or unreported, or existence checks are under way."""
        with self._lock:
            return bool(self._active or self._results or self._checking)

    def take_events(self) -> list[BlockEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def health(self) -> TierHealth:
        return self._breaker.health()

    def jobs_in_flight(self) -> int:
        """Jobs submitted and not yet reported."""
        with self._lock:
            return len(self._active)

    # --- blocking calls --------------------------------------------------------------------------

    def drain(self, timeout: float | None = None) -> None:
        """Block until every submitted job is reported (finished or failed); never aborts I/O.

        Raises :class:`TierDrainTimeout` after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._active:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TierDrainTimeout(
                        f"{self.tier_type} tier {self.label}: {len(self._active)} job(s) still in flight "
                        f"after {timeout}s"
                    )
                self._idle.wait(left)

    def shutdown(self) -> None:
        """Stop accepting jobs, let queued ones run for ``shutdown_grace`` seconds, fail the rest,
        join every thread (:meth:`_join_timeout` in all) and drop the CPU rows.

        Raises :class:`TierError` if a thread did not exit; the rows are then kept
        (the thread may still touch them) and calling ``shutdown()`` again retries.
        Idempotent once it succeeded.
        """
        if self._shut:
            return
        self._closed = True
        if self.shutdown_grace > 0:
            try:
                self.drain(self.shutdown_grace)
            except TierDrainTimeout:
                logger.warning("%s tier %s: jobs still queued at shutdown are failed", self.tier_type, self.label)
        for work in self._queue.close():
            self._abandon(work)
            if work.job is not None:
                self._complete(work, error="tier shut down before the work ran", dropped=not work.job.is_load)
        self._stopping.set()
        with self._lock:
            self._checking.clear()
        self._stop()
        join_timeout = min(self._join_timeout(), threading.TIMEOUT_MAX)  # a join past TIMEOUT_MAX raises
        deadline = time.monotonic() + join_timeout
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise TierError(
                f"{self.tier_type} tier {self.label}: threads {alive} did not stop within {join_timeout:.1f}s; "
                "the CPU rows may still be in use, so they were not released. Call shutdown() again to retry"
            )
        self._threads.clear()
        try:
            self._close()
        except Exception as exc:  # releasing the medium must not keep the rows pinned
            log_failure(logger, logging.WARNING, f"{self.tier_type} tier {self.label}: closing the medium failed", exc)
        self._rows = None
        self.context.release_rows()
        self._shut = True


__all__ = [
    "ALL_LANES",
    "READ_LANES",
    "JobState",
    "Lane",
    "ThreadedTier",
    "Work",
    "WorkQueue",
    "describe_error",
    "forget_frames",
]
