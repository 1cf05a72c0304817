"""The guard of ``return-time``: stop the learned holds while a sampled LRU beats them.

For each sampled reference the policy adds ``realised hit - sampled LRU hit``
to the current chain (:meth:`LruGuard.add`); :meth:`LruGuard.end_chain` folds
the chain's difference into the period's sums (a chain's blocks hit or miss
together, so the variance is taken over chains). At each solve,
:meth:`LruGuard.judge` decays the sums of the periods since the learned holds
were taken up; if they fall behind by ``SIGMAS`` standard deviations of the
paired difference, the policy holds every class 0 (LRU order) for a back-off
period that doubles with each consecutive loss. Called from the policy's
thread.
"""

from __future__ import annotations

SIGMAS = 1.0
"""The sampled LRU must beat the learned holds by this many standard deviations to stop them."""

DECAY = 0.8
"""Weight of the previous periods in the guard's sums."""

MAX_BACKOFF = 64
"""The longest back-off, in solve periods."""


class LruGuard:
    """Paired differences of realised and sampled-LRU hits, judged once per solve period."""

    def __init__(self) -> None:
        self.fallbacks = 0
        self.lru_until = 0
        self._backoff = 1
        self._period = [0, 0]  # this period, over chains: sum and sum of squares of the differences
        self._trial = [0.0, 0.0, 0]  # decayed sums since learning started, periods
        self.chain_diff = 0  # the current chain's difference
        self.chain_sampled = False  # the current chain had a sampled reference

    def add(self, hit: bool, lru_hit: bool) -> None:
        """A sampled reference of the current chain: realised ``hit``, and the sampled LRU's."""
        self.chain_diff += hit - lru_hit
        self.chain_sampled = True

    def end_chain(self, before: int = 0) -> int:
        """Fold the current chain into the period's sums; returns its request's difference so far.

        A request stored in pieces is one chain: ``before`` is the difference of
        its earlier pieces, and its square is replaced by the square of the total.
        """
        diff = self.chain_diff
        total = before + diff
        self._period[0] += diff
        self._period[1] += total * total - before * before
        self.chain_diff = 0
        self.chain_sampled = False
        return total

    def start_trial(self) -> None:
        """The learned holds are taken up: judge them from now on."""
        self._trial = [0.0, 0.0, 0]

    def judge(self, now: int, learning: bool, period: int) -> bool:
        """End a period at clock ``now``; True if the learned holds (in use: ``learning``) must stop.

        On a loss the back-off (``period`` references times 1, 2, 4 ... 64)
        sets :attr:`lru_until`; after four periods without one it halves.
        """
        diff, square = self._period
        self._period = [0, 0]
        if not learning:
            return False
        trial = self._trial
        trial[0] = DECAY * trial[0] + diff
        trial[1] = DECAY * trial[1] + square
        trial[2] += 1
        if trial[2] >= 2 and trial[0] < -SIGMAS * trial[1] ** 0.5:
            self.fallbacks += 1
            self.lru_until = now + self._backoff * period
            self._backoff = min(2 * self._backoff, MAX_BACKOFF)
            return True
        if trial[2] >= 4:
            self._backoff = max(1, self._backoff // 2)
        return False
