"""The manager's tier jobs: this step's promotions waiting for submission, and the jobs in flight.

A promotion (tier -> CPU load) is queued when a lookup finds its key in a secondary tier, its CPU row already
reserved; at step end the queue becomes one load job per (tier, request). A cascade (CPU -> tier store) is submitted
at once, one job per tier, its rows pinned once per tier by the caller. Every job goes through :meth:`Ledger.submit`,
whose one unwind path undoes what a refused job would have released on completion. :meth:`Ledger.poll` collects the
tiers' reports; :meth:`Ledger.finish` makes loaded blocks readable (or frees their rows, and the tier may not promise
them for a while: :mod:`kvtier.manager.waits`) and releases the pins of cascades. A job not reported within the wait
deadline is overdue (:meth:`Ledger.mark_overdue`): its tier gets no lookup and no cascade until it is; its rows stay
reserved or pinned, since the tier may still be using them.

Scheduler thread only; :meth:`Ledger.drain` blocks while the tiers drain.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from functools import partial
from time import perf_counter

import numpy as np

from kvtier.errors import TierError
from kvtier.keys import BlockKey
from kvtier.manager.handle import TierHandle
from kvtier.manager.joblog import log_failed_job, log_unknown_job
from kvtier.manager.tierset import TierSet
from kvtier.manager.waits import BlockWaits
from kvtier.primary import PrimaryTier
from kvtier.telemetry import ManagerCounters, TierTelemetry
from kvtier.tiers.base import NOTHING_POLLED, JobResult, TransferJob, polled_results
from kvtier.types import RequestContext

logger = logging.getLogger(__name__)


class _Job:
    """A tier job in flight (a plain slotted class: one is made per job on the scheduler thread)."""

    __slots__ = ("handle", "is_promotion", "job_id", "keys", "overdue", "queued", "slots", "submitted")

    def __init__(self, job_id: int, handle: TierHandle, is_promotion: bool, keys: list[BlockKey], slots: list[int],
                 submitted: float, queued: float) -> None:
        self.job_id = job_id
        self.handle = handle
        self.is_promotion = is_promotion
        self.keys = keys
        self.slots = slots  # the rows of ``keys`` (a cascade's stay pinned until the job is reported)
        self.submitted = submitted
        self.queued = queued  # a promotion's: when its first block was queued (its batch's clock)
        self.overdue = False  # not reported within the wait deadline


class _Batch:
    """This step's promotions of one (tier, request): one load job at step end."""

    __slots__ = ("keys", "request", "slots", "started")

    def __init__(self, request: RequestContext | None) -> None:
        self.request = request
        self.keys: list[BlockKey] = []
        self.slots: list[int] = []
        self.started = perf_counter()  # when its first promotion was queued: the step's clock


class Ledger:
    """Tier jobs of one manager; see the module docstring. ``len()`` is the jobs in flight."""

    def __init__(self, primary: PrimaryTier, counters: ManagerCounters, tiers: TierSet, waits: BlockWaits,
                 wait_timeout: float) -> None:
        self._primary, self._counters, self._tiers, self._waits = primary, counters, tiers, waits
        self._wait_timeout = wait_timeout
        self._jobs: dict[int, _Job] = {}
        self._unchecked: deque[_Job] = deque()  # jobs not yet checked against the deadline, oldest first
        waits.writer = self._promoting_into
        self._next_id = 1
        self._batches: dict[tuple[TierHandle, str | None], _Batch] = {}
        # The last promotion's (handle, request object, batch): the next one of the same request from the
        # same tier (a prefix scan's run) skips the batch lookup. Valid until the step's promotions are sent or dropped.
        self._last: tuple[TierHandle, RequestContext | None, _Batch] | None = None

    def __len__(self) -> int:
        return len(self._jobs)

    @property
    def busy(self) -> bool:
        """A job is in flight or a promotion waits for step end."""
        return bool(self._jobs or self._batches)

    def submit(self, handle: TierHandle, keys: list[BlockKey], slots: list[int], rows: np.ndarray, promotion: bool,
               request: RequestContext | None, tier_keys: list[BlockKey] | None = None, queued: float = 0.0) -> None:
        """Register a job of ``handle``'s tier moving ``keys`` (rows ``slots``, also as the array
        ``rows`` the tier gets) and hand it over; the tier gets ``tier_keys`` (default ``keys``);
        ``queued``: a promotion's batch clock (0: now).

        If the tier refuses it, the job is unregistered and what its completion would have
        released is released now: a promotion's reserved rows are freed, a cascade's pins dropped.
        A shutdown run inside the tier's call (by a signal handler) cleared every job: nothing is left.
        """
        job_id = self._next_id
        self._next_id = job_id + 1
        job = self._jobs[job_id] = _Job(job_id, handle, promotion, keys, slots, now := perf_counter(), queued or now)
        self._unchecked.append(job)
        telemetry = handle.telemetry
        if promotion:
            self._counters.promotion_jobs += 1
            telemetry.loads_in_flight += 1
        else:
            self._counters.cascade_jobs += 1
            telemetry.stores_in_flight += 1
        if handle.submit(TransferJob(job_id, keys if tier_keys is None else tier_keys, rows, promotion, request)):
            return
        if self._jobs.pop(job_id, None) is None:  # (cleared by that shutdown)
            return
        if promotion:
            telemetry.loads_in_flight -= 1
            self._primary.complete_write(keys, False)
            self._waits.loaded(keys, slots, set(keys))
            self._withhold(handle, keys)
        else:
            telemetry.stores_in_flight -= 1
            self._primary.unpin(keys)

    def submit_cascades(self, keys: list[BlockKey], slots: list[int], handles: list[TierHandle],
                        request: RequestContext | None) -> None:
        """One store job per tier of ``handles``; the rows are pinned once for each already. The
        jobs share one read-only array of the rows (a tier reads ``job.slots``, never writes it)."""
        rows = np.array(slots, dtype=np.int64)
        rows.flags.writeable = False
        for handle in handles:
            # The tier gets its own copy of the keys: the job's record pairs the manager's with the rows.
            self.submit(handle, keys, slots, rows, False, request, list(keys))

    def queue_promotion(self, handle: TierHandle, key: BlockKey, slot: int, request: RequestContext | None) -> bool:
        """Queue the load of ``key`` (into row ``slot``, reserved) from ``handle``'s tier for step
        end; True unless it joined the batch of the previous promotion (the caller then lists
        the request for step end)."""
        last = self._last
        if last is not None and last[0] is handle and last[1] is request:
            batch = last[2]
            first = created = False
        else:
            req_id = None if request is None else request.req_id
            found = self._batches.get((handle, req_id))
            created = found is None
            if found is None:
                found = self._batches[(handle, req_id)] = _Batch(request)
            batch = found
            self._last = (handle, request, batch)
            first = True
        batch.keys.append(key)
        batch.slots.append(slot)
        # The wait on the block begins now (the clock of a batch made by this call; a batch joined
        # later is no clock), or goes on from its RETRYs (or a failed promotion) before.
        waits = self._waits
        now = batch.started if first and created else perf_counter()
        if waits.since:
            clock = waits.since.get(key)
            waits.started[slot] = clock[0] if clock is not None and now - clock[1] <= self._wait_timeout else now
        else:
            waits.started[slot] = now
        return first

    def submit_promotions(self) -> None:
        """Step end: one load job per (tier, request) of this step's promotions."""
        if not self._batches:
            return
        batches, self._batches = self._batches, {}
        self._last = None
        for (handle, _), batch in batches.items():
            self.submit(handle, batch.keys, batch.slots, np.asarray(batch.slots, dtype=np.int64), True, batch.request,
                        queued=batch.started)

    def drop_promotions(self) -> None:
        """Forget the promotions not submitted yet (their rows are the caller's to release)."""
        self._batches.clear()
        self._last = None

    def poll(self, handles: Iterable[TierHandle]) -> None:
        """Collect and finish the jobs the tiers of ``handles`` report; then the jobs still in
        flight past the wait deadline are overdue (:meth:`mark_overdue`)."""
        for handle in handles:
            results, problem = handle.guard("poll_finished", partial(polled_results, handle.tier), NOTHING_POLLED)
            if problem is not None:
                handle.failed("poll_finished", TypeError(problem))
            for result in results:
                self.finish(handle, result)
        if self._unchecked:
            self.mark_overdue()

    def finish(self, handle: TierHandle, result: JobResult) -> None:
        """One job reported by ``handle``'s tier: loaded blocks become readable (failed ones
        free their rows); a cascade's pins are released and its admission told."""
        job = self._jobs.get(result.job_id)
        if job is None or job.handle is not handle:
            self._counters.unknown_job_results = n = self._counters.unknown_job_results + 1
            log_unknown_job(handle, result.job_id, n)
            return
        del self._jobs[result.job_id]
        if job.overdue:
            self._tiers.job_overdue(handle, False)
        telemetry, counters = handle.telemetry, self._counters
        seconds = result.seconds if result.seconds > 0 else perf_counter() - job.submitted
        if not job.is_promotion:
            telemetry.stores_in_flight -= 1
            self._primary.unpin_slots(job.keys, job.slots)
            if result.success:
                counters.cascades_succeeded += len(job.keys)
                telemetry.written.add(len(job.keys), result.bytes_moved, seconds)
            else:
                counters.cascades_failed += len(job.keys)
                stored = len(result.succeeded(job.keys))
                telemetry.written.add(stored, result.bytes_moved, seconds)
                log_failed_job(handle, "store", result, len(job.keys) - stored, len(job.keys),
                               telemetry.fail("cascade_job_failed", error=result.error))  # fmt: skip
            if handle.admission is not None:
                handle.admission.finished(result, seconds)
            return
        telemetry.loads_in_flight -= 1
        if not job.overdue:  # (an overdue job's blocks were answered MISS: no request waited for it)
            telemetry.promotion_wait_seconds.pending.append(perf_counter() - job.queued)
        if result.successful_keys is None:  # all or nothing
            ok, failed = (job.keys, []) if result.success else ([], job.keys)
        else:
            ok_set = set(ok := result.succeeded(job.keys))
            failed = [k for k in job.keys if k not in ok_set]
        if ok:
            self._primary.complete_write(ok, True)
        self._waits.loaded(job.keys, job.slots, set(failed) if failed else ())
        if failed:
            self._primary.complete_write(failed, False)
            self._withhold(handle, failed)
            log_failed_job(handle, "load", result, len(failed), len(job.keys),
                           telemetry.fail("promotion_job_failed", error=result.error))  # fmt: skip
        counters.promotions_succeeded += len(ok)
        counters.promotions_failed += len(failed)
        if ok and handle.admission is not None:
            handle.admission.served(ok)
        telemetry.read.add(len(ok), result.bytes_moved, seconds)

    def _withhold(self, handle: TierHandle, keys: list[BlockKey]) -> None:
        """The loads of ``keys`` from ``handle``'s tier failed (or were refused): the tier may
        not promise them for a while."""
        now = perf_counter()
        for key in keys:
            handle.waits.withhold(key, now)

    def _promoting_into(self, slot: int) -> TierTelemetry | None:
        """The telemetry of the tier whose promotion (queued or in flight) writes row ``slot``."""
        for job in self._jobs.values():
            if job.is_promotion and slot in job.slots:
                return job.handle.telemetry
        for (handle, _), batch in self._batches.items():
            if slot in batch.slots:
                return handle.telemetry
        return None

    def mark_overdue(self) -> None:
        """Mark the jobs in flight longer than the wait deadline overdue (each once, counted
        ``job_overdue``); their tiers then get no lookup and no cascade until they report.
        Right after a poll: a job done but not polled yet (a long engine step) is not overdue."""
        unchecked = self._unchecked
        limit = perf_counter() - self._wait_timeout
        jobs = self._jobs
        while unchecked:
            job = unchecked[0]
            in_flight = jobs.get(job.job_id) is job
            if in_flight and job.submitted >= limit:
                break
            unchecked.popleft()  # reported already, or overdue now
            if in_flight:
                job.overdue = True
                job.handle.telemetry.fail("job_overdue")
                self._tiers.job_overdue(job.handle, True)

    def drain(self, handles: list[TierHandle], timeout: float | None) -> None:
        """Wait for every tier of ``handles`` to finish its jobs (never aborting one halfway), then
        finish what they report. ``timeout`` (None: none) is shared by the tiers, each waited
        for at most the time left. Raises :class:`TierError` if a tier cannot drain in time,
        or if a job is still unreported after all drained."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle in handles:
            handle.drain(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.poll(handles)
        if self._jobs:
            raise TierError(f"{len(self._jobs)} tier job(s) still unreported after drain; the CPU tier was not reset")

    def clear(self, handles: Iterable[TierHandle]) -> None:
        """Every tier stopped: no job of theirs is in flight any more."""
        self._jobs.clear()
        self._unchecked.clear()
        self.drop_promotions()
        for handle in handles:
            handle.telemetry.stores_in_flight = handle.telemetry.loads_in_flight = handle.overdue = 0


__all__ = ["Ledger"]
