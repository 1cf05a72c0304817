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
from collections.abc import Iterator
from types import FrameType
from typing import Any

#: The signals turned into exceptions (a command ends with status 128 + the signal's number).
INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread like Ctrl-C (a :class:`KeyboardInterrupt`, so code
    that already cleans up after Ctrl-C cleans up after it too); ``signum`` is the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Deferral:
    """The main thread's deferral state: how deep in :func:`interrupts_deferred`, and the signal held
    back there (a second one raises at once: :func:`_on_signal`)."""

    depth = 0
    pending: int | None = None


def interrupt_for(signum: int) -> KeyboardInterrupt:
    """The exception that signal ``signum`` raises: :class:`KeyboardInterrupt` for SIGINT, else
    :class:`Terminated`."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    """The installed handler (main thread): raise now, or remember the signal inside a deferral; a
    second signal while one is held back raises at once (a user who presses Ctrl-C again means it:
    a release that hangs can still be abandoned)."""
    if _Deferral.depth > 0 and _Deferral.pending is None:
        _Deferral.pending = signum
        return
    _Deferral.pending = None
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
            # (None: a handler installed from C, which Python could not put back: left alone)
            if signal.getsignal(sig) not in (signal.SIG_IGN, None):
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
    ends as interrupted. A second signal meanwhile raises at once. Keep the blocks short and
    bounded (building something, registering its release, releasing it): a signal waits for the
    block to end. (A signal landing in the few bytecodes of entering or leaving the block is raised
    at once, never lost.)
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


class DeferredReleases(contextlib.ExitStack):
    """An :class:`contextlib.ExitStack` whose releases all run inside one :func:`interrupts_deferred`:
    a signal that lands while they run (between two of them included) waits until the last one
    has run. Register each release in the same deferral as the step that acquired its resource."""

    def __exit__(self, *exc_details: Any) -> bool | None:
        with interrupts_deferred():
            return super().__exit__(*exc_details)
