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

Memory: at most ``max_sessions`` sessions (a 64-bit hash of their id, never
the client's string, and two numbers), the oldest forgotten first. Called from the policy's thread only.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from kvtier.keys import session_digest

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
        self._last: OrderedDict[int, tuple[int, float]] = OrderedDict()  # id's hash -> (clock, seconds announced)
        self._log_rate = 0.0
        self.samples = 0

    def __len__(self) -> int:
        return len(self._last)

    def observe(self, session: str, now: int, expected_s: float | None) -> None:
        """``session``'s request ended at clock ``now``, announcing its next in ``expected_s``
        seconds (None: not said). Its previous request's announcement, if any, gives a sample."""
        key = session_digest(session)
        last = self._last.pop(key, None)
        if last is not None and not math.isnan(last[1]) and now > last[0]:
            sample = math.log((now - last[0]) / max(last[1], MIN_SECONDS))
            self.samples += 1
            weight = max(WEIGHT, 1 / self.samples)
            self._log_rate += weight * (sample - self._log_rate)
        self._last[key] = (now, math.nan if expected_s is None else expected_s)
        if len(self._last) > self._max:
            self._last.popitem(last=False)

    def references(self, seconds: float) -> float | None:
        """The references expected to pass in ``seconds`` (None: too few returns seen yet)."""
        if self.samples < MIN_SAMPLES:
            return None
        return math.exp(self._log_rate) * max(seconds, MIN_SECONDS)


REACH_BINS = 64
"""Bins of :class:`HoldBudget`'s histogram of return times: four per doubling, from 1 reference."""


class HoldBudget:
    """How far ahead an expected return is worth holding for, so that the held blocks fit.

    Holding a conversation of ``b`` blocks for a return ``r`` references ahead
    costs ``b * r`` block-references and gains ``b`` hits: the cheapest are the
    soonest returns. The budget keeps a histogram, by return time, of the
    block-references the announced returns would cost, and the references
    elapsed, both decayed with ``half_life``; :meth:`reach` is the longest
    return such that holding every return up to it keeps, on average, at most
    ``share`` of the capacity held (Little's law: occupancy = cost per
    reference). O(``REACH_BINS``) per request; fixed memory.
    """

    def __init__(self, capacity: int, share: float, half_life: float) -> None:
        self._room = share * capacity
        self._half_life = half_life
        self._cost = [0.0] * REACH_BINS
        self._elapsed = 0.0
        self._then = 0

    def add(self, now: int, blocks: int, returns_in: float) -> None:
        """A request of ``blocks`` blocks (its whole prefix) announced a return ``returns_in``
        references after ``now``."""
        if now > self._then:
            decay = 0.5 ** ((now - self._then) / self._half_life)
            self._cost = [c * decay for c in self._cost]
            self._elapsed = self._elapsed * decay + (now - self._then)
            self._then = now
        b = min(REACH_BINS - 1, max(0, int(4 * math.log2(max(returns_in, 1.0)))))
        self._cost[b] += blocks * returns_in

    def reach(self) -> float:
        """The longest return (references) worth holding for now (0: none yet)."""
        if self._elapsed <= 0:
            return 0.0
        budget = self._room * self._elapsed
        spent = 0.0
        for b, cost in enumerate(self._cost):
            spent += cost
            if spent > budget:
                return float(2 ** (b / 4))  # the lower edge of the first bin past the budget
        return math.inf


__all__ = ["MIN_SAMPLES", "REACH_BINS", "HoldBudget", "SessionClock"]
