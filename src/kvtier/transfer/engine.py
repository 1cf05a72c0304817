"""The worker-side copy engine: asynchronous FIFO copy jobs between a device KV pool and CPU rows.

Used by engine workers (the vLLM integration) and by ``kvtier bench``'s
simulated device. A job is a :class:`~kvtier.transfer.plan.CopyPlan` (or, for
simple callers, a list of ``(dst, src)`` buffer pairs, turned into one).

* Host plans (both sides in host memory) are executed by the host backend on
  the engine's own copy thread.
* Device plans are issued at submit time on a dedicated CUDA stream (after
  waiting for the submitter's current stream, so stores see finished compute)
  by the device backend -- vLLM's batched swap op when the vLLM integration
  provides it, else one ``Tensor.copy_`` per merged copy -- and an event is
  recorded; the copy thread waits on the event before reporting.

Threading: ``submit``/``poll``/``wait`` are called from one owner thread (the
engine worker); copies run on the engine's own thread. Jobs complete in FIFO
order.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import KvtierError
from kvtier.failures import log_failure
from kvtier.transfer.backends import CopyBackend, HostCopyBackend, TorchCopyBackend
from kvtier.transfer.layout import BlockMapping
from kvtier.transfer.plan import CopyPlan

logger = logging.getLogger(__name__)

CopyPair = tuple[Any, Any]
"""``(dst, src)``: contiguous numpy arrays or torch tensors of equal byte size."""

Work = CopyPlan | Sequence[CopyPair]
"""What a job copies: a plan, or ``(dst, src)`` pairs."""


@dataclass(frozen=True)
class TransferResult:
    job_id: int
    success: bool
    bytes_moved: int = 0
    seconds: float = 0.0
    error: str | None = None


def as_plan(work: Work) -> CopyPlan:
    """``work`` as a :class:`CopyPlan` (pairs are converted; raises :class:`KvtierError` on bad pairs)."""
    return work if isinstance(work, CopyPlan) else CopyPlan.from_pairs(work)


def _synchronize(device: str) -> None:
    import torch

    torch.cuda.current_stream(device).synchronize()


def copy_blocks(work: Work, device_backend: CopyBackend | None = None) -> int:
    """Copy every block of ``work`` synchronously on the calling thread; returns bytes copied.

    Raises :class:`KvtierError` if a pair's sizes differ. Device copies are
    issued on the current stream and synchronized before returning.
    """
    plan = as_plan(work)
    if plan.on_host:
        HostCopyBackend().run(plan)
    else:
        keep = (device_backend or TorchCopyBackend()).run(plan)
        _synchronize(plan.device)
        del keep
    return plan.nbytes


@dataclass
class _Job:
    job_id: int
    plan: CopyPlan | None
    error: str | None = None
    event: Any = None
    """For device plans: the (start, end) CUDA timing events around the issued copies, and what the
    backend asked to keep alive until they finished."""


class TransferEngine:
    """Asynchronous FIFO copy jobs on one owned worker thread.

    ``submit`` only enqueues (and, for device plans, issues the copies on the
    engine's stream); ``poll`` returns finished jobs; ``wait`` blocks until the
    given jobs finished; ``shutdown`` finishes queued jobs and joins the thread
    (bounded by ``timeout``). ``device_backend`` executes device plans (default:
    :class:`~kvtier.transfer.backends.TorchCopyBackend`); host plans always use
    the host backend.
    """

    def __init__(self, name: str = "kvtier-transfer", device_backend: CopyBackend | None = None) -> None:
        self.host_backend: CopyBackend = HostCopyBackend()
        self.device_backend: CopyBackend = device_backend or TorchCopyBackend()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._done: list[TransferResult] = []
        self._done_lock = threading.Condition()
        self._pending: set[int] = set()
        self._stream: Any = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def prepare_host(self, mappings: Iterable[BlockMapping]) -> None:
        """Build the host backend's executor of each of ``mappings`` now, so that the first job of
        each costs what the others do (an engine's first load after a restart is a request's time
        to first token). Owner thread, while no job is in flight (the copy thread is idle);
        raises :class:`KvtierError` otherwise, or for a mapping the host backend cannot copy."""
        backend = self.host_backend
        if not isinstance(backend, HostCopyBackend):
            return
        with self._done_lock:
            if self._pending:
                raise KvtierError("prepare_host must be called while no copy job is in flight")
            for mapping in mappings:
                backend.copier(mapping)

    def _cuda_stream(self, device: str) -> Any:
        if self._stream is None:
            import torch

            self._stream = torch.cuda.Stream(device)
        return self._stream

    def submit(self, job_id: int, work: Work) -> None:
        """Enqueue one job. Device copies are issued here, on the engine's stream.

        A plan that cannot be built or issued does not raise: the job is
        reported failed by :meth:`poll`, like a copy that fails later.
        """
        if self._closed:
            raise KvtierError("TransferEngine is shut down; no new jobs are accepted")
        job = _Job(job_id, None)
        try:
            plan = as_plan(work)
            if not plan.on_host and plan.batches:
                job.event = self._issue_device(plan)
            job.plan = plan
        except Exception as exc:
            job.error = log_failure(logger, logging.ERROR, f"transfer job {job_id} could not be issued", exc,
                                    with_traceback=True)  # fmt: skip
        with self._done_lock:
            self._pending.add(job_id)
        self._queue.put(job)

    def _issue_device(self, plan: CopyPlan) -> Any:
        import torch

        stream = self._cuda_stream(plan.device)
        stream.wait_stream(torch.cuda.current_stream(plan.device))
        with torch.cuda.stream(stream):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            keep = self.device_backend.run(plan)
            end.record(stream)
        return (start, end, keep)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            result = self._execute(job)
            job.plan = job.event = None  # drop views of the rows before reporting
            with self._done_lock:
                self._done.append(result)
                self._pending.discard(job.job_id)
                self._done_lock.notify_all()

    def _execute(self, job: _Job) -> TransferResult:
        """Run (host plans) or await (device plans) one job; its seconds are the copy's own time."""
        start = time.perf_counter()
        plan = job.plan
        if plan is None:
            return TransferResult(job.job_id, False, 0, 0.0, job.error)
        try:
            if job.event is not None:
                begin, end, _ = job.event
                end.synchronize()
                seconds = begin.elapsed_time(end) / 1000.0
            else:
                self.host_backend.run(plan)
                seconds = time.perf_counter() - start
        except Exception as exc:
            error = log_failure(logger, logging.ERROR, f"transfer job {job.job_id} failed", exc, with_traceback=True)
            return TransferResult(job.job_id, False, 0, time.perf_counter() - start, error)
        return TransferResult(job.job_id, True, plan.nbytes, seconds)

    def poll(self) -> list[TransferResult]:
        """Finished jobs since the last call, each reported once."""
        with self._done_lock:
            done, self._done = self._done, []
        return done

    def has_pending(self) -> bool:
        with self._done_lock:
            return bool(self._pending)

    def wait(self, job_ids: Iterable[int] | None = None, timeout: float | None = None) -> None:
        """Block until the given jobs (default: all) finished. Raises on timeout."""
        wanted = None if job_ids is None else set(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._done_lock:
            while self._pending if wanted is None else (self._pending & wanted):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise KvtierError(f"transfer jobs still running after {timeout}s")
                self._done_lock.wait(remaining)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Finish queued jobs, stop and join the worker thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise KvtierError(f"transfer thread did not stop within {timeout}s")
