"""One call at a time, across threads, that a nested call on the same thread does not wait for.

:class:`OneCall` serializes the manager's :meth:`~kvtier.manager.core.TieringManager.shutdown`:
a call from another thread (an engine's shutdown path and its atexit hook) waits for the one
running, then sees what it left; a call nested in the running one on its own thread (a signal
handler that shuts down, run between two bytecodes of the running call) cannot wait for it,
since it would wait for itself: it asks :meth:`OneCall.nested` first and returns at once,
without the running call's outcome (that call raises if it fails).
"""

from __future__ import annotations

import threading


class OneCall:
    """A re-entrant lock (``lock``, taken with ``with``: entered and left in C, so an interrupt,
    KeyboardInterrupt from a signal, never finds it taken and not yet owned by a ``with`` block)
    that says whether this thread holds it. Any thread."""

    def __init__(self) -> None:
        self.lock = threading.RLock()

    def nested(self) -> bool:
        """This thread holds it already (the caller runs inside the block that holds it)."""
        return bool(self.lock._is_owned())  # type: ignore[attr-defined]


__all__ = ["OneCall"]
