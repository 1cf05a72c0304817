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
thread of the tier and blocks for at most its ``timeout``. Each HEAD is handed
the check's deadline and is bounded by the client's own request timeout (with a
resend that must fit the deadline), so a late HEAD ends by itself.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from kvtier.keys import BlockKey

FIRST_WINDOW = 8
"""A chain's first window of concurrent HEADs; each later window is twice the one before."""

_STOP_POLL = 0.1
"""A check waiting for HEADs looks at the tier's stopping event this often."""

Head = Callable[[BlockKey, float], bool]
"""Does the store hold a well-sized object for this key? Blocking; the second argument is the
check's deadline (``time.monotonic()``), which a resent request must fit; raises on a failed request."""


class HeadFanout:
    """A queue of HEADs served by tier-owned threads, and the chained check of a step's keys.

    ``head`` is called on the serving threads only. ``stopping`` is the tier's
    shutdown event: once it is set the serving threads cancel what is still
    queued and return (a HEAD already running ends within its request timeout).
    """

    def __init__(self, head: Head, stopping: threading.Event) -> None:
        self._head = head
        self._stopping = stopping
        self._tasks: queue.SimpleQueue[tuple[BlockKey, float, Future[bool]] | None] = queue.SimpleQueue()
        self._serving = 0

    def serve(self) -> None:
        """Thread target: run queued HEADs until :meth:`stop`; once the tier is stopping, queued
        HEADs are cancelled instead of run. Idle threads sleep on the queue (no polling)."""
        while True:
            task = self._tasks.get()
            if task is None:
                return
            key, deadline, answer = task
            if self._stopping.is_set():
                answer.cancel()
            # Only this thread moves a queued HEAD on, once (a cancelled one is dropped here)
            if not answer.set_running_or_notify_cancel():
                continue
            try:
                answer.set_result(self._head(key, deadline))
            except BaseException as exc:  # handed to the check, which reports it; this thread goes on
                answer.set_exception(exc)
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

    def _submit(self, key: BlockKey, deadline: float) -> Future[bool]:
        answer: Future[bool] = Future()
        if self._stopping.is_set():
            answer.cancel()  # never queued: nothing else touches it
        else:
            self._tasks.put((key, deadline, answer))
        return answer

    def check(
        self, chains: list[list[BlockKey]], timeout: float
    ) -> tuple[dict[BlockKey, bool], list[BaseException]]:
        """HEAD the keys of every chain, all chains at once, for at most ``timeout`` seconds.

        A chain (one request's unknown keys, in prefix order) goes out in
        windows of 8, 16, 32... concurrent HEADs and stops at its first absent
        key or failed request: the engine stops there too, so later keys stay
        unknown. Returns the answers and the errors met. A failed HEAD counts as
        absent; at the deadline, a HEAD still running counts as absent and one
        not started yet is cancelled, its key left unknown (one ``TimeoutError``
        in the errors counts both).
        """
        deadline = time.monotonic() + timeout
        answers: dict[BlockKey, bool] = {}
        errors: list[BaseException] = []
        # chain index -> (the window's start, its width, its keys with their answers); one window per
        # chain is out at a time, and each HEAD of it that finishes puts the chain's index in `finished`
        # (a done-callback), so a wake-up costs O(1), not a scan of every HEAD in flight.
        windows: dict[int, tuple[int, int, list[tuple[BlockKey, Future[bool]]]]] = {}
        unfinished: dict[int, int] = {}
        finished: queue.SimpleQueue[int] = queue.SimpleQueue()

        def launch(index: int, start: int, width: int) -> None:
            keys = chains[index][start : start + width]
            if not keys:
                return
            window = [(key, self._submit(key, deadline)) for key in keys]
            windows[index] = (start, width, window)
            unfinished[index] = len(window)
            note = functools.partial(_finished, finished, index)
            for _, answer in window:
                answer.add_done_callback(note)  # called at once if already done

        for index in range(len(chains)):
            launch(index, 0, FIRST_WINDOW)
        while windows:
            if self._stopping.is_set():  # shutdown: nobody waits for these answers any more
                for _, _, window in windows.values():
                    for _, answer in window:
                        answer.cancel()
                break
            left = deadline - time.monotonic()
            if left <= 0:
                errors.extend(_give_up(windows, answers, timeout))
                break
            try:
                index = finished.get(timeout=min(left, _STOP_POLL))
            except queue.Empty:
                continue
            unfinished[index] -= 1
            if unfinished[index]:
                continue
            start, width, window = windows.pop(index)
            del unfinished[index]
            if _read_window(window, answers, errors):
                launch(index, start + width, width * 2)
        return answers, errors


def _finished(finished: queue.SimpleQueue[int], index: int, _answer: Future[bool]) -> None:
    finished.put(index)


def _read_window(
    window: list[tuple[BlockKey, Future[bool]]], answers: dict[BlockKey, bool], errors: list[BaseException]
) -> bool:
    """Record a finished window in chain order; True if the chain goes on past it."""
    for key, answer in window:
        if answer.cancelled():  # the tier is shutting down: the key stays unknown
            return False
        failure = answer.exception()
        if failure is not None:
            errors.append(failure)
            answers[key] = False
            return False
        present = answer.result()
        answers[key] = present
        if not present:
            return False
    return True


def _give_up(
    windows: dict[int, tuple[int, int, list[tuple[BlockKey, Future[bool]]]]],
    answers: dict[BlockKey, bool],
    timeout: float,
) -> list[BaseException]:
    """At the deadline: keep what finished, count running HEADs as absent, cancel queued ones
    (their keys stay unknown); returns the errors met, with one ``TimeoutError`` for the HEADs
    that ran late or never started (the threads busy with earlier checks' late HEADs: a slow
    store, which the tier's breaker must hear of)."""
    late = waited = 0
    errors: list[BaseException] = []
    for _, _, window in windows.values():
        for key, answer in window:
            if answer.cancel():
                waited += 1
            elif answer.cancelled():
                continue
            elif not answer.done():
                answers[key] = False
                late += 1
            elif (failure := answer.exception()) is not None:
                answers[key] = False
                errors.append(failure)
            else:
                answers[key] = answer.result()
    windows.clear()
    if late or waited:
        errors.append(
            TimeoutError(
                f"{late} existence check(s) missed the {timeout}s deadline, {waited} more never started "
                "(every HEAD thread busy)"
            )
        )
    return errors


__all__ = ["FIRST_WINDOW", "Head", "HeadFanout"]
