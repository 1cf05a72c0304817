"""A tier's blocking calls under a deadline: ``drain()`` (for ``reset_cache``) and ``shutdown()``.

Each runs on a daemon thread of its own when a deadline is given, so a tier that never
returns is abandoned at the deadline instead of hanging the caller; the next attempt
waits for the call still running rather than calling it twice. Called from the thread
that resets or shuts down the manager, which it blocks up to the deadline.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class _BoundedCall:
    """``fn()`` on a daemon thread of its own, so its caller can stop waiting for it."""

    def __init__(self, fn: Callable[[], object], name: str) -> None:
        self.error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(fn,), name=name, daemon=True).start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the waiting thread, KeyboardInterrupt included
            self.error = exc
        finally:
            self._done.set()

    def wait(self, timeout: float | None) -> bool:
        """True once the call returned or raised (``error`` then says which)."""
        return self._done.wait(timeout)


class BlockingCalls:
    """A tier's blocking calls (``drain``, ``shutdown``) under a deadline: each runs on a daemon
    thread of its own, so one that overruns is abandoned, never waited on past its deadline.
    Called from the thread that resets or shuts down the manager."""

    def __init__(self, target: object, label: str) -> None:
        self._target = target
        self._label = label
        self._runs: dict[str, _BoundedCall] = {}  # calls still running past their deadline

    def running(self, call: str) -> bool:
        """An earlier ``call`` is still running, abandoned at its deadline."""
        return call in self._runs

    def run(self, call: str, wait: float | None, *args: Any) -> tuple[bool, BaseException | None]:
        """Run (or keep waiting for) ``target.call(*args)``: ``(True, its error or None)`` once it
        returned, ``(False, None)`` if it still runs after ``wait`` seconds (it is then left
        running; the next attempt waits for it again rather than calling it twice).

        Without a deadline (``wait`` None) and no earlier call still running, the call is made
        in this thread. KeyboardInterrupt/SystemExit raised by the call propagate; anything
        else it raises (``asyncio.CancelledError`` included) is its error, so the caller goes on
        to the next tier.
        """
        run = self._runs.get(call)
        if wait is None and run is None:
            try:
                getattr(self._target, call)(*args)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:
                return True, exc
            return True, None
        if run is None:
            method = getattr(self._target, call)
            run = self._runs[call] = _BoundedCall(lambda: method(*args), f"kvtier-{call}-{self._label}")
        if not run.wait(wait):
            return False, None
        del self._runs[call]
        if isinstance(run.error, (KeyboardInterrupt, SystemExit)):
            raise run.error  # inside the call: stop here
        return True, run.error


__all__ = ["BlockingCalls"]
