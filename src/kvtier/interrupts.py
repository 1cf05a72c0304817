"""Interrupts (Ctrl-C, SIGTERM, SIGHUP) as exceptions in the main thread, held back across the steps
that must not be cut in half.

The command line (:func:`kvtier.cli.main`) installs :func:`raising_interrupts`: each of these signals
then raises in the main thread (:class:`KeyboardInterrupt` for SIGINT, :class:`Terminated` for
SIGTERM and SIGHUP), so every ``finally`` runs and the command exits 130, 143 or 129 with its
temporary directory, its shared-memory region and its tiers released.

An exception raised at an arbitrary bytecode can land between a step that acquires something and
the step that registers its release: a temporary directory made but not yet returned to its owner,
a manager built but not yet under a ``try``, an object that started a thread and took a view of the
shared rows but was never assigned (its half-built ``self`` then lives on in the traceback and the
region cannot be unmapped). :func:`interrupts_deferred` marks such a step: a signal received inside
it is remembered and raised when the outermost such block exits, at a point where the acquired thing
is already in its owner's hands.

Contract: only the main thread receives these signals (Python runs signal handlers there), so the
deferral is kept for the main thread alone; in any other thread :func:`interrupts_deferred` does
nothing. Without :func:`raising_interrupts` installed (kvtier used as a library), Python's own
SIGINT handler raises at once and :func:`interrupts_deferred` holds nothing back. A signal that the
process inherited as ignored (``nohup`` ignores SIGHUP; a shell's background job ignores SIGINT)
stays ignored.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

_T = TypeVar("_T")

#: The signals turned into exceptions, and the exit status a command ends with on each (128 + number).
INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread like Ctrl-C (a :class:`KeyboardInterrupt`, so code
    that already cleans up after Ctrl-C cleans up after it too); ``signum`` is the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Deferral:
    """The main thread's deferral state: how deep in :func:`interrupts_deferred`, and the first signal
    received there (later ones add nothing: one interrupt ends the command)."""

    depth = 0
    pending: int | None = None


def interrupt_for(signum: int) -> KeyboardInterrupt:
    """The exception that signal ``signum`` raises: :class:`KeyboardInterrupt` for SIGINT, else
    :class:`Terminated`."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    """The installed handler (main thread): raise now, or remember the signal inside a deferral."""
    if _Deferral.depth > 0:
        if _Deferral.pending is None:
            _Deferral.pending = signum
        return
    raise interrupt_for(signum)


@contextlib.contextmanager
def raising_interrupts() -> Iterator[None]:
    """For the block's duration (main thread only; elsewhere nothing changes): SIGINT, SIGTERM and
    SIGHUP raise as described in the module docstring, unless the process inherited the signal as
    ignored. The previous handlers are restored on exit, and a deferral left open is reset."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[signal.Signals, Any] = {}
    try:
        for sig in INTERRUPT_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, _on_signal)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _Deferral.depth = 0
        _Deferral.pending = None


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold back the interrupt signals while the block runs (main thread; see the module docstring).

    A signal received inside is raised when the outermost deferral exits, whatever the block did
    (if the block raised, its exception becomes the interrupt's ``__context__``): the command still
    ends as interrupted. Keep the blocks short and bounded (building something, registering its
    release, releasing it): a signal waits for the block to end.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _Deferral.depth += 1
    try:
        yield
    finally:
        _Deferral.depth -= 1
        if _Deferral.depth == 0 and _Deferral.pending is not None:
            signum, _Deferral.pending = _Deferral.pending, None
            raise interrupt_for(signum)


def deferring_interrupts(release: Callable[[], _T]) -> Callable[[], _T]:
    """``release`` wrapped to run inside :func:`interrupts_deferred`: for
    a cleanup registered with an :class:`contextlib.ExitStack`, so a second Ctrl-C does not cut it."""

    def run() -> _T:
        with interrupts_deferred():
            return release()

    return run
