"""One call at a time, across threads, that a nested call on the same thread does not wait for.

:class:`OneCall` serializes the manager's :meth:`~kvtier.manager.core.TieringManager.shutdown`:
a call from another thread (an engine's shutdown path and its atexit hook) waits for the one
running, then sees what it left; a call nested in the running one on its own thread (a signal
handler that shuts down, run between two bytecodes of the running call) cannot wait for it,
since it would wait for itself, and is told so instead.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class OneCall:
    """A lock that knows which thread holds it. Any thread; never held across a return."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: int | None = None

    @contextmanager
    def held(self) -> Iterator[bool]:
        """Hold the lock for the block: True; or False, at once, when this thread holds it
        already (the block is nested in the call that holds it: it must not wait, nor act)."""
        me = threading.get_ident()
        if self._holder == me:
            yield False
            return
        with self._lock:
            self._holder = me
            try:
                yield True
            finally:
                self._holder = None


__all__ = ["OneCall"]
