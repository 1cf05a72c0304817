"""Failures on I/O threads: described in one line, logged as text, and let go of.

An exception raised while a thread moved bytes (a tier's I/O thread, a transfer
worker) has frames whose locals are
views of CPU rows. Kept alive (by a log handler that keeps records, such as
``logging.handlers.MemoryHandler``, pytest's capture or a log shipper; by a
reference cycle; by a result), it keeps those views alive, and the shared region
cannot be unmapped: ``shutdown()`` raises ``RegionBusyError``. So every tier, the
tier job platform and the transfer engine report a failure through
:func:`log_failure`: the record holds
strings only (no exception object, no ``exc_info``), and the exception's frames
are cleared and its traceback dropped right after.

Native client libraries may raise exceptions that are not ``Exception`` (obstore,
in Rust, raises pyo3's ``PanicException`` on an internal error). A tier thread
contains them like any error (:func:`ends_thread` says which ones it must not),
and :func:`describe_error` never shows their text: a panic message is internals,
not a message for a user. Pure functions; any thread.
"""

from __future__ import annotations

import logging
import traceback

from kvtier.errors import clear_exception_frames, exception_text

_ENDS_THREAD = (KeyboardInterrupt, SystemExit, GeneratorExit)


def ends_thread(exc: BaseException) -> bool:
    """True for the exceptions a tier thread passes on (interrupts, exit); a tier thread
    contains every other one, native panics included."""
    return isinstance(exc, _ENDS_THREAD)


def is_native_crash(exc: BaseException) -> bool:
    """True for an internal error of a native library (not an ``Exception``; e.g. a Rust panic)."""
    return not isinstance(exc, Exception) and not ends_thread(exc)


def describe_error(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (clients often append a multi-line debug dump);
    for a native library's internal error, a fixed sentence instead of its text. Never raises:
    an exception whose text cannot be made is ``Type: <unprintable Type>``."""
    if is_native_crash(exc):
        return "internal error of the storage client library (a crash inside it; details withheld)"
    try:
        first = _os_error_words(exc) if isinstance(exc, OSError) else str(exc).strip().split("\n", 1)[0].strip()
    except Exception:  # a broken __str__ (or strerror, filename) must not fail the report of the error
        first = exception_text(exc)
    if len(first) > limit:
        first = first[: limit - 3] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _os_error_words(exc: OSError) -> str:
    """An OSError as its words and the path it names, without the ``[Errno N]`` prefix of ``str()``."""
    if not exc.strerror:
        return str(exc).strip().split("\n", 1)[0].strip()
    return f"{exc.strerror}: {exc.filename}" if exc.filename is not None else exc.strerror


def forget_frames(exc: BaseException) -> None:
    """Drop the tracebacks of ``exc`` and its chain, clearing their finished frames first."""
    clear_exception_frames(exc, drop_traceback=True)


def log_failure(
    log: logging.Logger, level: int, message: str, exc: BaseException, *, with_traceback: bool = False,
    keep_traceback: bool = False,
) -> str:
    """Log ``"<message>: <Type>: <text>"`` for ``exc`` and let go of its frames; returns the
    ``Type: text`` part (:func:`describe_error`).

    The record holds one string (no exception object, no ``exc_info``), so a handler that
    keeps records keeps no view of a CPU row. ``with_traceback`` appends the formatted
    traceback as text (for unexpected errors; never for a native crash). Call it from the
    ``except`` block, then do not use ``exc``'s traceback again, unless ``keep_traceback``:
    for an exception also handed to a caller (raised, or carried by another error), whose
    frames' locals are cleared but whose traceback still says where it happened.
    """
    detail = describe_error(exc)
    text = f"{message}: {detail}"
    if with_traceback and not is_native_crash(exc) and exc.__traceback__ is not None:
        text += "\n" + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    clear_exception_frames(exc, drop_traceback=not keep_traceback)
    log.log(level, "%s", text)
    return detail


__all__ = ["describe_error", "ends_thread", "forget_frames", "is_native_crash", "log_failure"]
