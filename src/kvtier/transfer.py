"""Worker-side copies between a device KV pool and rows of the shared CPU region.

Used by engine workers (the vLLM integration) and by ``kvtier bench``'s
simulated device. A job is a list of ``(dst, src)`` buffer pairs of equal byte
size, one pair per block (or per block and layer); one copy call per pair is
about 3x faster here than a fancy-index gather.

* numpy arrays are copied with ``np.copyto`` on the engine's worker thread (the
  copy releases the GIL).
* torch tensors are copied with ``Tensor.copy_``. When either side is on a CUDA
  device the copies are issued on a dedicated CUDA stream (after waiting for the
  current stream, so stores see finished compute), an event is recorded, and the
  worker thread waits on the event before reporting.

Threading: ``submit``/``poll`` are called from one owner thread (the engine
worker); copies run on the engine's own thread. Jobs complete in FIFO order.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.errors import KvtierError

logger = logging.getLogger(__name__)

CopyPair = tuple[Any, Any]
"""``(dst, src)``: numpy arrays or torch tensors of equal byte size."""


@dataclass(frozen=True)
class TransferResult:
    job_id: int
    success: bool
    bytes_moved: int = 0
    seconds: float = 0.0
    error: str | None = None


def _nbytes(buf: Any) -> int:
    if isinstance(buf, np.ndarray):
        return int(buf.nbytes)
    return int(buf.numel() * buf.element_size())


def _is_torch(buf: Any) -> bool:
    return not isinstance(buf, np.ndarray) and hasattr(buf, "copy_")


def copy_blocks(pairs: Sequence[CopyPair]) -> int:
    """Copy every pair synchronously on the calling thread; returns bytes copied.

    Raises :class:`KvtierError` if a pair's sizes differ. CUDA copies are issued
    on the current stream and synchronized before returning.
    """
    total = 0
    cuda_used = False
    for dst, src in pairs:
        n = _nbytes(dst)
        if n != _nbytes(src):
            raise KvtierError(f"copy size mismatch: dst has {n} bytes, src has {_nbytes(src)}")
        if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
            np.copyto(dst, src, casting="no")
        else:
            import torch

            d = dst if _is_torch(dst) else torch.from_numpy(dst)
            s = src if _is_torch(src) else torch.from_numpy(src)
            cuda_used = cuda_used or d.is_cuda or s.is_cuda
            d.copy_(s, non_blocking=d.is_cuda or s.is_cuda)
        total += n
    if cuda_used:
        import torch

        torch.cuda.current_stream().synchronize()
    return total


class TransferEngine:
    """Asynchronous FIFO copy jobs on one owned worker thread.

    ``submit`` only enqueues; ``poll`` returns finished jobs; ``wait`` blocks
    until the given jobs finished; ``shutdown`` finishes queued jobs and joins
    the thread (bounded by ``timeout``).
    """

    def __init__(self, name: str = "kvtier-transfer") -> None:
        self._queue: queue.Queue[tuple[int, Sequence[CopyPair], Any] | None] = queue.Queue()
        self._done: list[TransferResult] = []
        self._done_lock = threading.Condition()
        self._pending: set[int] = set()
        self._stream: Any = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _cuda_stream(self) -> Any:
        if self._stream is None:
            import torch

            self._stream = torch.cuda.Stream()
        return self._stream

    def submit(self, job_id: int, pairs: Sequence[CopyPair]) -> None:
        """Enqueue one job. CUDA copies are issued here, on the engine's stream."""
        if self._closed:
            raise KvtierError("TransferEngine is shut down; no new jobs are accepted")
        event = None
        if pairs and any(_is_torch(b) and b.is_cuda for pair in pairs for b in pair):
            event = self._issue_cuda(pairs)
            pairs = []
        with self._done_lock:
            self._pending.add(job_id)
        self._queue.put((job_id, pairs, event))

    def _issue_cuda(self, pairs: Sequence[CopyPair]) -> Any:
        import torch

        stream = self._cuda_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                d = dst if _is_torch(dst) else torch.from_numpy(dst)
                s = src if _is_torch(src) else torch.from_numpy(src)
                d.copy_(s, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return (event, sum(_nbytes(d) for d, _ in pairs))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job_id, pairs, event = item
            start = time.perf_counter()
            try:
                if event is not None:
                    cuda_event, moved = event
                    cuda_event.synchronize()
                else:
                    moved = copy_blocks(pairs)
                result = TransferResult(job_id, True, moved, time.perf_counter() - start)
            except Exception as exc:
                logger.exception("transfer job %d failed", job_id)
                result = TransferResult(job_id, False, 0, time.perf_counter() - start, repr(exc))
            with self._done_lock:
                self._done.append(result)
                self._pending.discard(job_id)
                self._done_lock.notify_all()

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
