"""Test doubles for *collaborators* of the manager and the CPU tier.

:class:`RecordingLRU` is LRU that records the chains the CPU tier reports.
The scripted in-memory secondary tiers keep real bytes (copied out of and into the real shared rows), complete
jobs only when the test says so (or at once with ``auto_complete``), and can be
told to fail jobs, lookups or their own shutdown. :func:`wait_for_answer` is an engine whose
request waits on one block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from kvtier.keys import BlockKey
from kvtier.manager import TieringManager
from kvtier.policies import LRUPolicy
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TierUsage, TransferJob
from kvtier.types import LookupResult, OffloadPolicy, RequestContext


class RecordingLRU(LRUPolicy):
    """LRU that records each ``reference_chain`` call as (keys, slots, parent, hit), and which
    stores came as ``continue_chain`` (their index in ``chains``), and the slots ``end_request`` named."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.chains: list[tuple[list[BlockKey], list[int], int, bool]] = []
        self.continued: list[int] = []
        self.ended: list[int] = []

    def end_request(self, tail_slot: int) -> None:
        self.ended.append(tail_slot)

    def continue_chain(self, keys: Sequence[BlockKey], slots: Sequence[int], parent: int) -> None:
        self.continued.append(len(self.chains))
        super().continue_chain(keys, slots, parent)  # the base: a store's reference_chain

    def reference_chain(self, keys: Sequence[BlockKey], slots: Sequence[int], parent: int, hit: bool) -> None:
        self.chains.append((list(keys), list(slots), parent, hit))
        super().reference_chain(keys, slots, parent, hit)


CALLS: list[tuple[str, str]] = []
"""Global log of (tier label, method) for order assertions; tests clear it."""


class ScriptedTier(SecondaryTier):
    tier_type: ClassVar[str] = "scripted"
    medium: ClassVar[str] = "memory"

    def __init__(
        self,
        context: TierContext,
        *,
        auto_complete: bool = True,
        shutdown_error: BaseException | None = None,
        shutdown_gate: threading.Event | None = None,
        construct_error: Exception | None = None,
        request_level: bool = False,
        name: str = "",
        drop_context: bool = False,
    ) -> None:
        if construct_error is not None:
            raise construct_error
        super().__init__(context)
        self.name = name or f"tier{context.index}"
        self.data: dict[BlockKey, bytes] = {}
        self.auto_complete = auto_complete
        self.shutdown_error = shutdown_error
        self.shutdown_gate = shutdown_gate  # shutdown() hangs until it is set
        self.request_level = request_level
        self.queued: list[TransferJob] = []
        self.finished: list[JobResult] = []
        self.fail_keys: set[BlockKey] = set()
        self.retry_keys: set[BlockKey] = set()
        self.shutdown_calls = 0
        self.drop_context = drop_context  # a shutdown that succeeds drops self.context (its rows' holder)
        self.finished_requests: list[str] = []
        self.touched: list[BlockKey] = []
        self.drains = 0

    def lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        if key in self.retry_keys:
            return LookupResult.RETRY
        return LookupResult.HIT if key in self.data else LookupResult.MISS

    def submit_store(self, job: TransferJob) -> None:
        CALLS.append((self.name, "submit_store"))
        self.queued.append(job)
        if self.auto_complete:
            self.complete_all()

    def submit_load(self, job: TransferJob) -> None:
        CALLS.append((self.name, "submit_load"))
        self.queued.append(job)
        if self.auto_complete:
            self.complete_all()

    def complete_all(self, success: bool = True) -> None:
        """Run every queued job now (bytes really move between rows and ``data``)."""
        rows, n = self.context.rows, self.context.block_bytes
        for job in self.queued:
            ok: list[BlockKey] = []
            for key, slot in zip(job.keys, job.slots, strict=True):
                if not success or key in self.fail_keys:
                    continue
                if job.is_promotion:
                    if key not in self.data:
                        continue
                    rows[slot, :n] = np.frombuffer(self.data[key], dtype=np.uint8)
                else:
                    self.data[key] = rows[slot, :n].tobytes()
                ok.append(key)
            self.finished.append(JobResult(job.job_id, len(ok) == len(job.keys), frozenset(ok)))
        self.queued.clear()

    def poll_finished(self) -> list[JobResult]:
        done, self.finished = self.finished, []
        return done

    def touch(self, keys: Sequence[BlockKey], request: RequestContext | None) -> None:
        self.touched.extend(keys)

    def on_new_request(self, request: RequestContext) -> OffloadPolicy:
        return OffloadPolicy.REQUEST_LEVEL if self.request_level else OffloadPolicy.BLOCK_LEVEL

    def on_request_finished(self, request: RequestContext) -> None:
        CALLS.append((self.name, f"finished:{request.req_id}"))
        self.finished_requests.append(request.req_id)

    def has_pending_work(self) -> bool:
        return bool(self.queued)

    def usage(self) -> TierUsage:
        return TierUsage(len(self.data) * self.context.block_bytes, None, len(self.data))

    def drain(self, timeout: float | None = None) -> None:
        self.drains += 1
        self.complete_all()

    def shutdown(self) -> None:
        CALLS.append((self.name, "shutdown"))
        self.shutdown_calls += 1
        if self.shutdown_gate is not None:
            self.shutdown_gate.wait()
        if self.shutdown_error is not None:
            raise self.shutdown_error
        if self.drop_context:
            del self.context

    def describe(self) -> dict[str, Any]:
        return {"type": self.tier_type, "name": self.name}


def wait_for_answer(mgr: TieringManager, key: BlockKey, req: RequestContext, limit: float,
                    step_seconds: float = 0.01) -> tuple[LookupResult, float]:
    """Ask for ``key`` every engine step (``on_schedule_end``, then ``step_seconds`` of sleep), as
    an engine whose request waits, until a HIT or a MISS or ``limit`` seconds: the last answer and
    the seconds waited."""
    start = time.monotonic()
    while True:
        answer = mgr.lookup(key, req)
        waited = time.monotonic() - start
        if answer is LookupResult.HIT or answer is LookupResult.MISS or waited > limit:
            return answer, waited
        mgr.on_schedule_end()
        time.sleep(step_seconds)
