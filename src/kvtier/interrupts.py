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
import os
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
    """The main thread's deferral state: how deep in :func:`interrupts_deferred`, the signal held
    back there (a second one raises at once: :func:`_on_signal`), and the handlers
    :func:`raising_interrupts` replaced (put back in a forked child)."""

    depth = 0
    pending: int | None = None
    replaced: dict[signal.Signals, Any] = {}
    restoring = False  # raising_interrupts is putting the handlers back: a signal now goes to ``late``
    late: list[int] = []


def interrupt_for(signum: int) -> KeyboardInterrupt:
    """The exception that signal ``signum`` raises: :class:`KeyboardInterrupt` for SIGINT, else
    :class:`Terminated`."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    """The installed handler (main thread): raise now, or remember the signal inside a deferral; a
    second signal while one is held back raises at once (a user who presses Ctrl-C again means it:
    a release that hangs can still be abandoned)."""
    if _Deferral.restoring:
        _Deferral.late.append(signum)
        return
    if _Deferral.depth > 0 and _Deferral.pending is None:
        _Deferral.pending = signum
        return
    _Deferral.pending = None
    raise interrupt_for(signum)


def _reset_in_child() -> None:
    """After a fork, in the child: the parent's deferral is not the child's (nothing there would
    ever end it, and a ``Process.terminate()`` would be held back for good), and the handlers go
    back to what they were before :func:`raising_interrupts`."""
    _Deferral.depth, _Deferral.pending = 0, None
    replaced, _Deferral.replaced = _Deferral.replaced, {}
    for sig, handler in replaced.items():
        with contextlib.suppress(ValueError, OSError):  # (a child forked from a thread of an embedding host)
            signal.signal(sig, handler)


os.register_at_fork(after_in_child=_reset_in_child)


@contextlib.contextmanager
def raising_interrupts() -> Iterator[None]:
    """For the block's duration (main thread only; elsewhere nothing changes): SIGINT, SIGTERM and
    SIGHUP raise as described in the module docstring, unless the process inherited the signal as
    ignored. On exit the previous handlers are put back (a signal landing meanwhile is raised again
    once they are, for the handler put back: not raised halfway, leaving this one on the others)
    and the deferral state is what it was on entry (nested in a deferral, a signal held back stays
    held back)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[signal.Signals, Any] = {}
    outer_replaced, depth = _Deferral.replaced, _Deferral.depth
    if not outer_replaced:  # the outermost: the handlers a forked child puts back
        _Deferral.replaced = previous
    try:
        for sig in INTERRUPT_SIGNALS:
            # (None: a handler installed from C, which Python could not put back: left alone)
            if signal.getsignal(sig) not in (signal.SIG_IGN, None):
                previous[sig] = signal.signal(sig, _on_signal)
        yield
    finally:
        _Deferral.restoring = True
        try:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        finally:
            _Deferral.restoring = False
            _Deferral.replaced, _Deferral.depth = outer_replaced, depth
            if depth == 0:
                _Deferral.pending = None
            late, _Deferral.late = _Deferral.late, []
            for signum in late:  # (to this thread: the handler put back runs, or the default action)
                signal.raise_signal(signum)


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
    has run, and one more raises at once (abandoning the release under way), also when they run
    because of an interrupt: a supervisor's or a terminal's signal arriving with the first (SIGHUP
    and SIGTERM as a terminal closes) does not cut them. Register each release in the same
    deferral as the step that acquired its resource."""

    def __exit__(self, *exc_details: Any) -> bool | None:
        with interrupts_deferred():
            return super().__exit__(*exc_details)
