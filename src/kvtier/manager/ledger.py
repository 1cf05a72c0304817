"""The manager's tier jobs: this step's promotions waiting for submission, and the jobs in flight.

A promotion (tier -> CPU load) is queued when a lookup finds its key in a
secondary tier, its CPU row already reserved; at step end the queue becomes one
load job per (tier, request). A cascade (CPU -> tier store) is submitted at
once, one job per tier, its rows pinned once per tier by the caller. Every job
goes through :meth:`Ledger.submit`, whose one unwind path undoes what a refused
job would have released on completion. :meth:`Ledger.poll` collects the tiers'
reports; :meth:`Ledger.finish` makes loaded blocks readable (or frees their rows)
and releases the pins of cascades.

Scheduler thread only; :meth:`Ledger.drain` blocks while the tiers drain.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from time import perf_counter

import numpy as np

from kvtier.errors import TierError
from kvtier.keys import BlockKey
from kvtier.manager.tierset import TierHandle
from kvtier.primary import PrimaryTier
from kvtier.telemetry import ManagerCounters
from kvtier.tiers.base import JobResult, TransferJob
from kvtier.types import RequestContext

logger = logging.getLogger(__name__)


class _Job:
    """A tier job in flight (a plain slotted class: one is made per job on the scheduler thread)."""

    __slots__ = ("handle", "is_promotion", "keys", "slots", "submitted")

    def __init__(self, handle: TierHandle, is_promotion: bool, keys: list[BlockKey], slots: list[int]) -> None:
        self.handle = handle
        self.is_promotion = is_promotion
        self.keys = keys
        self.slots = slots  # the rows of ``keys`` (a cascade's stay pinned until the job is reported)
        self.submitted = perf_counter()


class _Batch:
    """This step's promotions of one (tier, request): one load job at step end."""

    __slots__ = ("keys", "request", "slots")

    def __init__(self, request: RequestContext | None) -> None:
        self.request = request
        self.keys: list[BlockKey] = []
        self.slots: list[int] = []


class Ledger:
    """Tier jobs of one manager; see the module docstring. ``len()`` is the jobs in flight."""

    def __init__(self, primary: PrimaryTier, counters: ManagerCounters) -> None:
        self._primary = primary
        self._counters = counters
        self._jobs: dict[int, _Job] = {}
        self._next_id = 1
        self._batches: dict[tuple[TierHandle, str | None], _Batch] = {}
        # The last promotion's (handle, request object, batch): the next one of the same request
        # from the same tier (a prefix scan's run) skips the batch lookup. Valid until the
        # step's promotions are submitted or dropped.
        self._last: tuple[TierHandle, RequestContext | None, _Batch] | None = None

    def __len__(self) -> int:
        return len(self._jobs)

    @property
    def busy(self) -> bool:
        """A job is in flight or a promotion waits for step end."""
        return bool(self._jobs or self._batches)

    def submit(self, handle: TierHandle, keys: list[BlockKey], slots: list[int], rows: np.ndarray,
               promotion: bool, request: RequestContext | None, tier_keys: list[BlockKey] | None = None) -> None:
        """Register a job of ``handle``'s tier moving ``keys`` (rows ``slots``, also as the array
        ``rows`` the tier gets) and hand it over; the tier gets ``tier_keys`` (default ``keys``).

        If the tier refuses it, the job is unregistered and what its completion would have
        released is released now: a promotion's reserved rows are freed, a cascade's pins dropped.
        """
        job_id = self._next_id
        self._next_id = job_id + 1
        self._jobs[job_id] = _Job(handle, promotion, keys, slots)
        telemetry = handle.telemetry
        if promotion:
            self._counters.promotion_jobs += 1
            telemetry.loads_in_flight += 1
        else:
            self._counters.cascade_jobs += 1
            telemetry.stores_in_flight += 1
        if handle.submit(TransferJob(job_id, keys if tier_keys is None else tier_keys, rows, promotion, request)):
            return
        del self._jobs[job_id]
        if promotion:
            telemetry.loads_in_flight -= 1
            self._primary.complete_write(keys, False)
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
            first = False
        else:
            req_id = None if request is None else request.req_id
            found = self._batches.get((handle, req_id))
            if found is None:
                found = self._batches[(handle, req_id)] = _Batch(request)
            batch = found
            self._last = (handle, request, batch)
            first = True
        batch.keys.append(key)
        batch.slots.append(slot)
        return first

    def submit_promotions(self) -> None:
        """Step end: one load job per (tier, request) of this step's promotions."""
        if not self._batches:
            return
        batches, self._batches = self._batches, {}
        self._last = None
        for (handle, _), batch in batches.items():
            self.submit(handle, batch.keys, batch.slots, np.asarray(batch.slots, dtype=np.int64), True, batch.request)

    def drop_promotions(self) -> None:
        """Forget the promotions not submitted yet (their rows are the caller's to release)."""
        self._batches.clear()
        self._last = None

    def poll(self, handles: Iterable[TierHandle]) -> None:
        """Collect and finish the jobs the tiers of ``handles`` report."""
        for handle in handles:
            for result in handle.call("poll_finished", default=()):
                self.finish(handle, result)

    def finish(self, handle: TierHandle, result: JobResult) -> None:
        """One job reported by ``handle``'s tier: loaded blocks become readable (failed ones
        free their rows); a cascade's pins are released and its admission told."""
        job = self._jobs.get(result.job_id)
        if job is None or job.handle is not handle:
            self._counters.unknown_job_results += 1
            logger.error("secondary tier #%d reported unknown job %d; ignored", handle.index, result.job_id)
            return
        del self._jobs[result.job_id]
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
                telemetry.written.add(len(result.succeeded(job.keys)), result.bytes_moved, seconds)
                telemetry.fail("cascade_job_failed", error=result.error)
            if handle.admission is not None:
                handle.admission.finished(result, seconds)
            return
        telemetry.loads_in_flight -= 1
        if result.successful_keys is None:  # all or nothing
            ok, failed = (job.keys, []) if result.success else ([], job.keys)
        else:
            ok = result.succeeded(job.keys)
            ok_set = set(ok)
            failed = [k for k in job.keys if k not in ok_set]
        if ok:
            self._primary.complete_write(ok, True)
        if failed:
            self._primary.complete_write(failed, False)
            telemetry.fail("promotion_job_failed", error=result.error)
            logger.debug("promotion job %d from tier #%d: %d of %d keys failed (%s)",
                         result.job_id, handle.index, len(failed), len(job.keys), result.error)
        counters.promotions_succeeded += len(ok)
        counters.promotions_failed += len(failed)
        telemetry.read.add(len(ok), result.bytes_moved, seconds)

    def drain(self, handles: list[TierHandle], timeout: float | None) -> None:
        """Wait for every tier of ``handles`` to finish its jobs (never aborting one halfway), then
        finish what they report. Raises :class:`TierError` if a tier cannot drain within
        ``timeout``, or if a job is still unreported after all drained."""
        for handle in handles:
            handle.tier.drain(timeout)
        self.poll(handles)
        if self._jobs:
            raise TierError(f"{len(self._jobs)} tier job(s) still unreported after drain; the CPU tier was not reset")

    def clear(self, handles: Iterable[TierHandle]) -> None:
        """Every tier stopped: no job of theirs is in flight any more."""
        self._jobs.clear()
        self.drop_promotions()
        for handle in handles:
            handle.telemetry.stores_in_flight = handle.telemetry.loads_in_flight = 0


__all__ = ["Ledger"]
