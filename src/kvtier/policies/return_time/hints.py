"""Application hints in ``return-time``: per-session return times, in seconds, on the policy's clock.

A serving stack may tell, per request (see :mod:`kvtier.request_control`),
its conversation's id, that the conversation ended, and when the client
expects to come back (seconds). The policy's clock counts block references,
not seconds: :class:`SessionClock` learns how many references pass per
second of a promised return from the sessions themselves: when a session's
next request ends, the references since its previous one, over the seconds
that one announced, is one sample (a running mean of its logarithm, so a
burst of long or short pauses moves it by a bounded factor). Until
``MIN_SAMPLES`` returns were seen it gives no estimate: an expected return
time is then not used.

Memory: at most ``max_sessions`` sessions (their id and two numbers), the
oldest forgotten first. Called from the policy's thread only.
"""

from __future__ import annotations

import math
from collections import OrderedDict

MIN_SAMPLES = 8
"""Returns seen before :meth:`SessionClock.references` answers."""

WEIGHT = 1 / 32
"""Weight of a new sample in the running mean of log(references per second)."""

MIN_SECONDS = 1.0
"""Announced pauses shorter than this count as this long (a 0 s return says nothing of the rate)."""


class SessionClock:
    """References per second of announced return time, learned from sessions that came back."""

    def __init__(self, max_sessions: int) -> None:
        self._max = max(1, max_sessions)
        self._last: OrderedDict[str, tuple[int, float]] = OrderedDict()  # id -> (clock, seconds announced)
        self._log_rate = 0.0
        self.samples = 0

    def __len__(self) -> int:
        return len(self._last)

    def observe(self, session: str, now: int, expected_s: float | None) -> None:
        """``session``'s request ended at clock ``now``, announcing its next in ``expected_s``
        seconds (None: not said). Its previous request's announcement, if any, gives a sample."""
        last = self._last.pop(session, None)
        if last is not None and not math.isnan(last[1]) and now > last[0]:
            sample = math.log((now - last[0]) / max(last[1], MIN_SECONDS))
            self.samples += 1
            weight = max(WEIGHT, 1 / self.samples)
            self._log_rate += weight * (sample - self._log_rate)
        self._last[session] = (now, math.nan if expected_s is None else expected_s)
        if len(self._last) > self._max:
            self._last.popitem(last=False)

    def references(self, seconds: float) -> float | None:
        """The references expected to pass in ``seconds`` (None: too few returns seen yet)."""
        if self.samples < MIN_SAMPLES:
            return None
        return math.exp(self._log_rate) * max(seconds, MIN_SECONDS)


__all__ = ["MIN_SAMPLES", "SessionClock"]
