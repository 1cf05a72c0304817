"""The measured guard of ``admission: learned``: does declining gain more hits than it loses?

:class:`~kvtier.manager.admission.LearnedAdmission` declines a store whose blocks the
CPU tier's policy predicts much less likely to be read again within the tier's horizon
than the average stored block. That is a prediction. :class:`ReturnWatch` measures what
it is worth against writing every store, on the same stream, whichever of the two the
tier follows, the way the policy's own guard measures its evictions.

The tier holds about its capacity's worth (the horizon, ``H`` blocks) of the most
recent writes. Writing every store, a block stays for ``H`` *offered* blocks (every
store's, written or not); following the rule, an admitted block stays for ``H``
*admitted* blocks, longer by what was declined meanwhile; a use (the tier serves the
block, or the CPU tier's hit touches it) renews a stay. When a followed block comes
back after it left the CPU tier (the tier serves it, or it is stored again: recomputed)
at an age of ``a`` admitted and ``t`` offered blocks, what the tier did is observed and
what the other world would have done is judged by the ages:

* following the rule, an admitted block the tier serves is a hit the rule *gained* when
  ``t > H`` (writing everything would have pushed it out), a declined block recomputed a
  hit it *lost* when ``t <= H`` (writing everything would have kept it);
* writing everything (fallen back), an admitted block recomputed (the tier lost it) is a
  hit the rule would have *gained* when ``a <= H``, a block the rule declines, written
  because of the fallback and served, a hit it would have *lost*.

Both are counted on a spatial hash sample of the keys (by a key's last two bytes, keys
being hashes: every block when ``H`` is at most :data:`SAMPLED_MAX`, a share of them
above it), in either state, so the guard keeps measuring after it falls back. Once
:data:`MIN_EVIDENCE` sampled hits were counted, the guard *falls back* (the admission
writes every store) when the rule lost more than it gained by two standard deviations
of the counts, and resumes when it gained more by as much. The counts are halved every
:data:`WINDOW` sampled hits, so a workload that changes is followed. What it counts are
block hits, not prefix hits (a block early in a shared prefix is worth more than one),
and the horizon is the tier's capacity, not what its hot blocks leave to new ones. A
guard bounds a sustained loss; it cannot make one impossible: until enough was counted,
the predictions stand.

Owned by one ``LearnedAdmission``; every call comes from the scheduler thread and
touches only memory: a two-byte test per block, dictionary operations for the sampled
ones. Memory: at most :data:`SAMPLED_MAX` keys in each of its two tables.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvtier.keys import BlockKey

SAMPLED_MAX = 8192
"""The most keys each of the guard's two tables follows (the sampled share of the tier's horizon)."""

MIN_EVIDENCE = 32
"""Sampled hits gained and lost, together, before the guard judges."""

WINDOW = 2048
"""Sampled hits gained and lost, together, after which both counts are halved (the past fades)."""

_HASH_SPACE = 1 << 16

ADMITTED = 0
DECLINED = 1
OVERRIDDEN = 2
ENDED = 3
"""What became of a store: written; declined by the policy's prediction; written although the rule
declines it, because the guard fell back; declined by the hints (a conversation's last request:
not the prediction the guard measures, not written whatever it says)."""


class ReturnWatch:
    """Sampled hits the learned rule gained and lost against writing everything, and the guard's
    state (see the module docstring). ``horizon``: the tier's capacity in blocks."""

    __slots__ = ("_admitted", "_below", "_declined", "_high", "_low", "admitted_clock", "fallbacks", "fallen_back",
                 "gained", "horizon", "lost", "offered_clock")  # fmt: skip

    def __init__(self, horizon: int) -> None:
        self.horizon = max(1, horizon)
        self._below = max(1, min(_HASH_SPACE, _HASH_SPACE * SAMPLED_MAX // self.horizon))
        # A key is sampled when its last two bytes, little-endian, are below ``_below``: its last
        # byte below ``_high``, or equal to it with the one before below ``_low``.
        self._high, self._low = divmod(self._below, 256)
        self._admitted: OrderedDict[BlockKey, tuple[int, int]] = OrderedDict()  # key: both clocks then
        self._declined: OrderedDict[BlockKey, tuple[int, bool]] = OrderedDict()  # key: offered clock then, written
        self.admitted_clock = 0
        """Blocks admitted so far (what the rule writes)."""
        self.offered_clock = 0
        """Blocks offered so far: admitted, declined or overridden (what writing everything writes)."""
        self.gained = 0.0
        self.lost = 0.0
        """Sampled hits the rule gained and lost (halved every :data:`WINDOW`)."""
        self.fallen_back = False
        self.fallbacks = 0

    @property
    def sampled_share(self) -> float:
        """The share of keys the guard follows."""
        return self._below / _HASH_SPACE

    @property
    def state(self) -> str:
        """``learning`` (too few hits counted), ``judging`` or ``fallen_back``."""
        if self.fallen_back:
            return "fallen_back"
        return "judging" if self.gained + self.lost >= MIN_EVIDENCE else "learning"

    def stored(self, keys: Sequence[BlockKey], outcome: int) -> None:
        """A cascade of ``keys`` had ``outcome`` (ADMITTED, DECLINED, OVERRIDDEN or ENDED):
        followed keys among them came back (stored again: recomputed); sampled keys are
        followed from now (but ENDED ones: not the rule's)."""
        high, low = self._high, self._low
        admitted, declined = self._admitted, self._declined
        if outcome == ADMITTED:
            self.admitted_clock += len(keys)
        if outcome != ENDED:
            self.offered_clock += len(keys)
        follow: OrderedDict[BlockKey, Any] | None = None
        if outcome == ADMITTED:
            follow, entry = admitted, (self.admitted_clock, self.offered_clock)
        elif outcome != ENDED:
            follow, entry = declined, (self.offered_clock, outcome == OVERRIDDEN)
        for key in keys:
            last = key[-1]
            if last > high or (last == high and (len(key) < 2 or key[-2] >= low)):
                continue  # not sampled
            if key in admitted or key in declined:
                self._came_back(key, served=False)
            if follow is not None:
                follow[key] = entry
        self._expire()

    def served(self, keys: Sequence[BlockKey]) -> None:
        """The tier served ``keys`` (a load from it succeeded): followed keys came back, and are
        followed again from now (a use renews a block's stay in the tier, in either world)."""
        high, low, admitted = self._high, self._low, self._admitted
        entry = (self.admitted_clock, self.offered_clock)
        for key in keys:
            last = key[-1]
            if last < high or (last == high and len(key) > 1 and key[-2] < low):
                self._came_back(key, served=True)
                admitted[key] = entry
        self._expire()

    def touched(self, keys: Sequence[BlockKey]) -> None:
        """The tier was touched with ``keys`` (the CPU tier served them): followed keys in the
        tier are followed again from now (a use renews a block's stay in the tier)."""
        high, low, admitted, declined = self._high, self._low, self._admitted, self._declined
        for key in keys:
            last = key[-1]
            if last > high or (last == high and (len(key) < 2 or key[-2] >= low)):
                continue
            if key in admitted:
                admitted[key] = (self.admitted_clock, self.offered_clock)
                admitted.move_to_end(key)
            elif declined.get(key, (0, False))[1]:
                declined[key] = (self.offered_clock, True)
                declined.move_to_end(key)

    def _came_back(self, key: BlockKey, served: bool) -> None:
        """``key`` came back, ``served`` by the tier or not (stored again): a hit gained, lost, or
        neither. What the tier did is observed; what the other world would have done is judged
        by the two clocks. Following the rule: an admitted key served is gained if writing
        everything would have pushed it out; a declined key stored again is lost if writing
        everything would have kept it. Writing everything (fallen back): an admitted key stored
        again is gained if the rule would have kept it; a key the rule declines, written anyway
        and served, is lost. (A declined key the tier served, written by another engine sharing
        it, cost nothing.)"""
        horizon = self.horizon
        then = self._admitted.pop(key, None)
        if then is not None:
            kept_by_rule = self.admitted_clock - then[0] <= horizon
            if kept_by_rule and (not served if self.fallen_back else self.offered_clock - then[1] > horizon and served):
                self._count(gained=1.0)
            return
        declined = self._declined.pop(key, None)
        if declined is None:
            return
        offered, written = declined
        if self.offered_clock - offered <= horizon and served == written:  # written: served; else: recomputed
            self._count(lost=1.0)

    def _expire(self) -> None:
        """Forget what no longer counts either way: admitted keys older than the horizon in
        admitted blocks, the others older than it in offered blocks (or past the table's size)."""
        admitted, declined = self._admitted, self._declined
        oldest = self.admitted_clock - self.horizon
        while admitted and (next(iter(admitted.values()))[0] < oldest or len(admitted) > SAMPLED_MAX):
            admitted.popitem(last=False)
        oldest = self.offered_clock - self.horizon
        while declined and (next(iter(declined.values()))[0] < oldest or len(declined) > SAMPLED_MAX):
            declined.popitem(last=False)

    def _count(self, gained: float = 0.0, lost: float = 0.0) -> None:
        self.gained += gained
        self.lost += lost
        if self.gained + self.lost >= WINDOW:
            self.gained /= 2.0
            self.lost /= 2.0
        total = self.gained + self.lost
        if total < MIN_EVIDENCE:
            return
        margin = 4.0 * total  # (2 standard deviations)^2 of the difference of two counts
        difference = self.lost - self.gained
        if not self.fallen_back and difference > 0 and difference * difference > margin:
            self.fallen_back = True
            self.fallbacks += 1
        elif self.fallen_back and difference < 0 and difference * difference > margin:
            self.fallen_back = False


__all__ = ["ADMITTED", "DECLINED", "ENDED", "MIN_EVIDENCE", "OVERRIDDEN", "SAMPLED_MAX", "WINDOW", "ReturnWatch"]
