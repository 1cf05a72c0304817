"""The kvtier exception hierarchy.

Every error kvtier raises on purpose derives from :class:`KvtierError`. Messages
name the offending value and, where there is one, the fix.
"""

from __future__ import annotations

import os
import reprlib
import traceback
from dataclasses import dataclass


def clear_exception_frames(exc: BaseException, *, drop_traceback: bool = False) -> None:
    """Clear the locals of the finished frames in ``exc``'s traceback and in those of its chain.

    Frames that touched the shared CPU region hold views of its rows; an exception
    kept by a caller (or in a reference cycle) would keep them alive, and the region
    cannot be unmapped while any view exists. ``drop_traceback`` also detaches the
    tracebacks (for exceptions that are only logged); leave it False for one that is
    re-raised, so its traceback still says where it happened.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)
            if drop_traceback:
                current.__traceback__ = None
        pending.extend((current.__cause__, current.__context__))


def interrupt_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The :class:`KeyboardInterrupt` (Ctrl-C, or a signal raised like it) that caused ``exc``, found
    along its ``__cause__`` and ``__context__`` chain, or None. Python 3.11 wraps an interrupt that
    lands in a class body's ``__set_name__`` in a :class:`RuntimeError`: code that turns a failure
    into an error message re-raises the interrupt instead, so the command still ends as interrupted.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, KeyboardInterrupt):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, or ``<unprintable Type>`` when that raises (an exception class of a plugin or a
    client library whose ``__str__`` is broken, or returns something other than a str): text for
    a log line or another error's message, which must not fail in turn. Any thread."""
    try:
        return str(exc)
    except Exception:
        return f"<unprintable {type(exc).__name__}>"


def int_text(value: int) -> str:
    """An integer for a message: its digits, or past 128 bits its size (``str()`` of an int of
    more than 4,300 digits raises ValueError, and a long one says nothing more)."""
    return str(value) if value.bit_length() <= 128 else f"an integer of {value.bit_length()} bits"


class BoundedRepr(reprlib.Repr):
    """``reprlib``'s bounded repr, also for an integer too long to print: ``reprlib`` formats every
    ``int`` in full before shortening it, and one past Python's 4,300-digit limit raises ValueError.
    The repr of values in error messages (set its limits per use)."""

    def repr_int(self, x: int, level: int) -> str:
        return super().repr_int(x, level) if x.bit_length() <= 128 else f"<int of {x.bit_length()} bits>"


class KvtierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


class InvalidKeyError(KvtierError, ValueError):
    """A block key given to the manager is not ``bytes`` of 1 to ``MAX_KEY_BYTES`` bytes."""

    @classmethod
    def of(cls, key: object, max_bytes: int) -> InvalidKeyError:
        """The error for ``key``, which is not ``bytes`` of 1 to ``max_bytes`` bytes."""
        if not isinstance(key, bytes):
            return cls(f"block keys must be bytes, got {type(key).__name__} {key!r:.80}")
        return cls(f"block key of {len(key)} bytes ({key[:16].hex()}...): keys must be 1 to {max_bytes} bytes")


class ManagerClosedError(KvtierError, RuntimeError):
    """A :class:`~kvtier.manager.TieringManager` method was called after ``shutdown()``."""

    @classmethod
    def of(cls, call: str) -> ManagerClosedError:
        """The error for a call of the manager's method ``call`` after ``shutdown()``."""
        return cls(
            f"TieringManager.{call}() called after shutdown(): only the calls that read what the manager knows "
            "answer now (shutdown(), is_shut_down, stats(), is_idle, tier_descriptors(), tier_label(), "
            "request_control(), telemetry, block_bytes)"
        )


class RegionError(KvtierError):
    """The shared CPU region could not be created, attached or released."""


class InsufficientSpaceError(RegionError):
    """The file system backing the region (usually /dev/shm) lacks the space asked for."""


class RegionBusyError(RegionError):
    """Cleanup of the region was refused because views of its memory are still alive."""


class UnsafeEntryError(KvtierError):
    """An entry of a shared directory is not a regular file of ours (symlink, FIFO, device,
    directory, another user's file, ...): it was never followed, opened for I/O or deleted."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"{self.path} is {reason}" if reason.startswith(("a ", "an ")) else f"{self.path}: {reason}")


class CorruptValueError(KvtierError):
    """A value read from a tier failed its header, length or checksum verification."""


class ForeignFormatError(CorruptValueError):
    """A value that carries kvtier's magic in a format version this release cannot read: written
    by a newer (or another) release sharing the tier. Not served, like a corrupt value, but not
    proven corrupt either, so a tier never deletes it (its writer can read it)."""


class TierError(KvtierError):
    """A secondary tier failed an operation."""


class TierDrainTimeout(TierError):
    """A tier did not finish its in-flight jobs within the drain timeout."""


class TierShutdownTimeout(TierError):
    """A secondary tier's ``shutdown()`` overran its share of the manager's shutdown deadline.

    The call was abandoned (it may still be running, on a daemon thread) and counts as a
    failure, so the primary tier stays mapped; a later ``shutdown()`` waits for it again.
    """


@dataclass(frozen=True)
class TierFailure:
    """One secondary tier's failure during shutdown."""

    index: int
    tier_type: str
    class_name: str
    error: BaseException

    def __str__(self) -> str:
        return (
            f"tier #{self.index} (type={self.tier_type}, class={self.class_name}): "
            f"{type(self.error).__name__}: {exception_text(self.error)}"
        )


class TierShutdownError(TierError):
    """One or more secondary tiers failed to shut down.

    ``failures`` holds every failure of the attempt, in tier order; the last one
    is also chained as ``__cause__``. The primary tier and its shared mapping were
    left intact, because a failed tier may still be using the CPU rows. Calling
    ``TieringManager.shutdown()`` again retries only the failed tiers.
    """

    def __init__(self, failures: list[TierFailure]) -> None:
        self.failures = list(failures)
        lines = "; ".join(str(f) for f in self.failures)
        super().__init__(
            f"{len(self.failures)} secondary tier(s) failed to shut down; the primary tier "
            f"was kept mapped. Call shutdown() again to retry them. Failures: {lines}"
        )

    @property
    def errors(self) -> list[BaseException]:
        """The underlying exceptions, in tier order."""
        return [f.error for f in self.failures]
