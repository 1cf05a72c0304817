"""The kvtier exception hierarchy.

Every error kvtier raises on purpose derives from :class:`KvtierError`. Messages
name the offending value and, where there is one, the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class KvtierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


class InvalidKeyError(KvtierError, ValueError):
    """A block key given to the manager is not ``bytes`` of 1 to ``MAX_KEY_BYTES`` bytes."""


class ManagerClosedError(KvtierError, RuntimeError):
    """A :class:`~kvtier.manager.TieringManager` method was called after ``shutdown()``."""


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
            f"{type(self.error).__name__}: {self.error}"
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
