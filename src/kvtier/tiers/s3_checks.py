"""Existence checks of the S3 tier: a step's HEADs fanned out over tier-owned threads.

Why threads and blocking HEADs, not ``asyncio`` and ``head_async``: obstore
resolves an async call from one of its own runtime threads, which takes the
GIL to hand the answer to the event loop and releases it again inside that
hand-off. The loop can see the answer, the tier shut down and the process
reach interpreter finalization while that runtime thread still waits to take
the GIL back, and a thread taking the GIL during finalization is ended with
``pthread_exit``, which aborts a Rust thread (SIGABRT at exit, seen on loaded
machines about one exit in fifteen). A blocking HEAD runs to its end on the
calling thread, so once the threads of :class:`HeadFanout` are joined no
obstore call can reach back into Python.

Threads: :meth:`HeadFanout.start` starts the serving threads through the
tier (which joins them at shutdown, after :meth:`HeadFanout.stop`); :meth:`HeadFanout.check` runs on a worker
thread of the tier and blocks for at most its ``timeout``. Each HEAD is bounded
by the client's own request timeout, so a late HEAD ends by itself.
"""

from __future__ import annotations

import collections
import functools
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from kvtier.keys import BlockKey

FIRST_WINDOW = 8
"""A chain's first window of concurrent HEADs; each later window is twice the one before."""

HEDGE_FRACTION = 0.4
"""The S3 tier hedges a HEAD still running this far into its check's deadline (``hedge_after``)."""

_STOP_POLL = 0.1
"""A check waiting for HEADs looks at the tier's stopping event this often."""

Head = Callable[[BlockKey], bool]
"""Does the store hold a well-sized object for this key? Blocking; raises on a failed request."""


class HeadFanout:
    """A queue of HEADs served by tier-owned threads, and the chained check of a step's keys.

    ``head`` is called on the serving threads only. ``stopping`` is the tier's
    shutdown event: once it is set the serving threads cancel what is still
    queued and return (a HEAD already running ends within its request timeout).
    """

    def __init__(self, head: Head, stopping: threading.Event) -> None:
        self._head = head
        self._stopping = stopping
        self._tasks: queue.SimpleQueue[tuple[BlockKey, Future[bool]] | None] = queue.SimpleQueue()
        self._serving = 0
        self._busy = 0  # serving threads inside a HEAD (under _busy_lock): hedges go only to idle ones
        self._busy_lock = threading.Lock()

    def serve(self) -> None:
        """Thread target: run queued HEADs until :meth:`stop`; once the tier is stopping, queued
        HEADs are cancelled instead of run. Idle threads sleep on the queue (no polling)."""
        while True:
            task = self._tasks.get()
            if task is None:
                return
            key, answer = task
            if self._stopping.is_set():
                answer.cancel()
            # Only this thread moves a queued HEAD on, once (a cancelled one is dropped here)
            if not answer.set_running_or_notify_cancel():
                continue
            with self._busy_lock:
                self._busy += 1
            try:
                answer.set_result(self._head(key))
            except BaseException as exc:  # handed to the check, which reports it; this thread goes on
                answer.set_exception(exc)
            finally:
                with self._busy_lock:
                    self._busy -= 1
            del task, answer  # an exception's traceback holds this frame: no cycle through the future

    def start(self, threads: int, start_thread: Callable[[str, Callable[[], None]], None]) -> None:
        """Start ``threads`` serving threads through the tier's ``start_thread`` (which joins them)."""
        for i in range(threads):
            start_thread(f"head-{i}", self.serve)
            self._serving += 1

    def stop(self) -> None:
        """Shutdown, after the tier's stopping event is set: wake every serving thread to return."""
        for _ in range(self._serving):
            self._tasks.put(None)
        self._serving = 0

    def _idle_threads(self) -> int:
        """Serving threads neither in a HEAD nor about to take a queued one (a hint: it may be stale
        by the time it is used)."""
        with self._busy_lock:
            busy = self._busy
        return self._serving - busy - self._tasks.qsize()

    def _submit(self, key: BlockKey) -> Future[bool]:
        answer: Future[bool] = Future()
        if self._stopping.is_set():
            answer.cancel()  # never queued: nothing else touches it
        else:
            self._tasks.put((key, answer))
        return answer

    def check(
        self, chains: list[list[BlockKey]], timeout: float, hedge_after: float | None = None
    ) -> tuple[dict[BlockKey, bool], list[BaseException], int]:
        """HEAD the keys of every chain, all chains at once, for at most ``timeout`` seconds.

        A chain (one request's unknown keys, in prefix order) goes out in windows of 8, 16, 32...
        concurrent HEADs and stops at its first absent key or failed request: the engine stops
        there too, so later keys stay unknown. A HEAD of a window still running ``hedge_after``
        seconds after the window went out is sent a second time (a hedge: a request lost on the
        way costs that long, not the deadline), as far as HEAD threads are idle then (hedges never
        queue behind busy threads: a store slow throughout gets none). A key's first answer wins;
        it fails once all its HEADs failed; a decided key's or a read window's HEADs not started
        are cancelled. Returns the answers, the errors met and the hedges sent. A failed HEAD
        counts as absent; at the deadline, a HEAD still running counts as absent and one not
        started yet is cancelled, its key left unknown (one ``TimeoutError`` counts both).
        """
        deadline = time.monotonic() + timeout
        answers: dict[BlockKey, bool] = {}
        errors: list[BaseException] = []
        hedged = 0
        # chain index -> its window out (one per chain at a time). Each HEAD that finishes puts
        # (chain index, window serial, key position) in `finished` (a done-callback), so a wake-up
        # costs O(1), not a scan of every HEAD in flight (and no future refers to its window).
        windows: dict[int, _Window] = {}
        finished: queue.SimpleQueue[tuple[int, int, int]] = queue.SimpleQueue()
        serials = itertools.count()
        # (hedge time, chain index, serial) of each window launched, in launch order: hedge times only grow
        hedges: collections.deque[tuple[float, int, int]] = collections.deque()

        def send(window: _Window, pos: int) -> Future[bool]:
            head = self._submit(window.keys[pos])
            window.heads[pos].append(head)
            where = (window.index, window.serial, pos)
            head.add_done_callback(functools.partial(_finished, finished, where))  # at once if done
            return head

        def launch(index: int, start: int, width: int) -> None:
            keys = chains[index][start : start + width]
            if not keys:
                return
            window = windows[index] = _Window(index, next(serials), start, width, keys)
            if hedge_after is not None:
                hedges.append((time.monotonic() + hedge_after, index, window.serial))
            for pos in range(len(keys)):
                send(window, pos)

        for index in range(len(chains)):
            launch(index, 0, FIRST_WINDOW)
        while windows:
            if self._stopping.is_set():  # shutdown: nobody waits for these answers any more
                for out in windows.values():
                    out.cancel_all()
                break
            now = time.monotonic()
            if now >= deadline:
                errors.extend(_give_up(windows, answers, timeout))
                break
            while hedges and hedges[0][0] <= now:
                _, index, serial = hedges.popleft()
                due = windows.get(index)
                if due is not None and due.serial == serial:
                    hedged += due.hedge(send, self._idle_threads())
            wake = min(deadline, hedges[0][0]) if hedges else deadline
            try:
                index, serial, pos = finished.get(timeout=max(0.0, min(wake - now, _STOP_POLL)))
            except queue.Empty:
                continue
            done = windows.get(index)
            if done is None or done.serial != serial:  # a window already read: a hedge's twin answered late
                continue
            if not done.decide(pos) or done.left:
                continue
            del windows[index]
            done.cancel_all()  # keys past the chain's end, and twins of decided keys, not started yet
            if _read_window(done, answers, errors):
                launch(index, done.start + done.width, done.width * 2)
        return answers, errors, hedged


_CANCELLED = object()
"""A key's outcome when its HEADs were cancelled (the tier is stopping): the key stays unknown."""


class _Window:
    """One chain's window of HEADs: its keys, each key's HEADs (the first, and its hedge if
    sent) and each key's outcome once decided (the answer, the failure, or ``_CANCELLED``).
    Touched by the checking thread only (the HEADs' threads only queue wake-ups)."""

    __slots__ = ("heads", "index", "keys", "left", "outcomes", "serial", "start", "width")

    def __init__(self, index: int, serial: int, start: int, width: int, keys: list[BlockKey]) -> None:
        self.index = index  # the chain's
        self.serial = serial  # unique within the check
        self.start = start
        self.width = width
        self.keys = keys
        self.heads: list[list[Future[bool]]] = [[] for _ in keys]
        self.outcomes: list[object] = [None] * len(keys)
        self.left = len(keys)

    def hedge(self, send: Callable[[_Window, int], Future[bool]], idle: int) -> int:
        """Send a second HEAD for up to ``idle`` undecided keys whose only HEAD is running, in
        chain order; returns how many went out (not those cancelled at once: the tier stopping)."""
        sent = 0
        for pos, heads in enumerate(self.heads):
            if sent >= idle:
                break
            if self.outcomes[pos] is None and len(heads) == 1 and heads[0].running():
                sent += not send(self, pos).cancelled()
        return sent

    def decide(self, pos: int) -> bool:
        """Decide key ``pos`` from its finished HEADs if it can be: its first answer, else (every
        HEAD of it finished) its first failure or ``_CANCELLED``; a decided key's HEADs not
        started yet are cancelled. True if it was decided now."""
        if self.outcomes[pos] is not None:
            return False
        heads = self.heads[pos]
        pending = any(not head.done() for head in heads)  # first: one may finish during the scan
        failure: BaseException | None = None
        for head in heads:
            if not head.done() or head.cancelled():
                continue
            exc = head.exception()
            if exc is None:
                self.outcomes[pos] = head.result()
                break
            if failure is None:
                failure = exc
        else:
            if pending:
                return False  # another HEAD of it may still answer
            self.outcomes[pos] = failure if failure is not None else _CANCELLED
        for head in heads:
            head.cancel()  # (only one not started yet is cancelled)
        self.left -= 1
        return True

    def cancel_all(self) -> None:
        """Cancel every HEAD of the window not started yet."""
        for heads in self.heads:
            for head in heads:
                head.cancel()


def _finished(finished: queue.SimpleQueue[tuple[int, int, int]], where: tuple[int, int, int], _: Future[bool]) -> None:
    finished.put(where)


def _read_window(window: _Window, answers: dict[BlockKey, bool], errors: list[BaseException]) -> bool:
    """Record a decided window in chain order; True if the chain goes on past it."""
    for key, outcome in zip(window.keys, window.outcomes, strict=True):
        if outcome is _CANCELLED:  # the tier is shutting down: the key stays unknown
            return False
        if isinstance(outcome, BaseException):
            errors.append(outcome)
            answers[key] = False
            return False
        answers[key] = bool(outcome)
        if not outcome:
            return False
    return True


def _give_up(windows: dict[int, _Window], answers: dict[BlockKey, bool], timeout: float) -> list[BaseException]:
    """At the deadline: keep what was decided, count keys with a HEAD still running as absent,
    cancel queued HEADs (their keys stay unknown); returns the errors met, with one
    ``TimeoutError`` for the keys whose HEADs ran late or never started (the threads busy with
    earlier checks' late HEADs: a slow store, which the tier's breaker must hear of)."""
    late = waited = 0
    errors: list[BaseException] = []
    for window in windows.values():
        for pos, key in enumerate(window.keys):
            window.decide(pos)
            if window.outcomes[pos] is None:
                for head in window.heads[pos]:
                    head.cancel()  # one still queued never starts now (a running one cannot be cancelled)
                if not window.decide(pos):  # a HEAD of it is still running
                    answers[key] = False
                    late += 1
                    continue
                if window.outcomes[pos] is _CANCELLED:  # none of its HEADs ever started
                    waited += 1
                    continue
            outcome = window.outcomes[pos]
            if outcome is _CANCELLED:
                continue
            elif isinstance(outcome, BaseException):
                answers[key] = False
                errors.append(outcome)
            else:
                answers[key] = bool(outcome)
    windows.clear()
    if late or waited:
        errors.append(
            TimeoutError(
                f"{late} existence check(s) missed the {timeout}s deadline, {waited} more never started "
                "(every HEAD thread busy)"
            )
        )
    return errors


__all__ = ["FIRST_WINDOW", "HEDGE_FRACTION", "Head", "HeadFanout"]
