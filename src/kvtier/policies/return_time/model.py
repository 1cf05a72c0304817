"""Return times of sampled blocks, and the holding times per class they imply.

The learning half of :class:`~kvtier.policies.return_time.ReturnTimePolicy`,
kept apart from its queue so it can be tested alone. Time is counted in block
references (the policy's clock), never in seconds, so the same statistics hold
for a fast and a slow engine.

* :class:`ReturnSampler` follows a fixed sample of keys (chosen by fingerprint)
  whether they are cached or not: a sampled key's next reference gives a return
  time for the class it had at its last reference; a key not seen again within
  the horizon (or pushed out of the table) gives a censored observation.
* The sampler also keeps an LRU over the sampled keys only, of the sampled
  share of the capacity: its hit ratio estimates a full LRU's (spatial
  sampling, as in SHARDS), which guards the learned policy.
* :class:`ReturnTimeModel` turns the observations into a Kaplan-Meier survival
  curve per class over log-spaced ages, and solves for how long to hold a block
  of each class: the holding times that maximise expected hits per block of
  cache time, with the expected occupancy (Little's law) equal to the capacity.
  That is a fractional knapsack over the upper concave hulls of each class's
  (space, hits) curve: segments are taken by decreasing hit density, and the
  segment that does not fit is taken for a fraction of that class's references.

Statistics decay geometrically at each solve, so the model follows a workload
that changes. Everything is called from the policy's thread.
"""

from __future__ import annotations

import bisect
import itertools
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.policies.fingerprints import FREE, FingerprintLists

SAMPLE_SCALE = 256
"""Sampling resolution: a key is sampled when its last byte falls below a threshold.

Keys are digests, so their bytes are uniform; reading a byte of the key (not
Python's per-process randomised hash) makes the sample, and so every replay,
the same in every process.
"""


def sample_threshold(rate: float) -> int:
    """The threshold on a key's last byte that samples about ``rate`` of all keys."""
    return max(1, min(SAMPLE_SCALE, round(rate * SAMPLE_SCALE)))


class ReturnSampler:
    """The last reference (time, class) of each sampled key, for ``horizon`` references.

    :meth:`observe` returns the previous class of a key it follows (or -1),
    leaves the key's age in :attr:`last_age` and in :attr:`lru_hit` whether an
    LRU of ``lru_size`` entries over the sampled keys would have held it;
    censored observations go to the model as they happen.

    The keys are one recency list in two segments of one
    :class:`FingerprintLists`: the ``lru_size`` most recent (list 0, the
    sampled LRU's content) and the older ones (list 1), so that the LRU
    estimate (spatial sampling, as in SHARDS: an LRU of the sampled share of
    the capacity over the sampled keys hits like the full LRU) costs no second
    table. ``lru_size`` is at most ``size``.
    """

    def __init__(self, size: int, horizon: int, model: ReturnTimeModel, lru_size: int = 1) -> None:
        if not 1 <= lru_size <= size:
            raise ValueError(f"lru_size must lie in 1..{size}, got {lru_size}")
        self.size = size
        self.lru_size = lru_size
        self.horizon = horizon
        self.model = model
        self.table = FingerprintLists(size, lists=2)
        self.times = array("q", bytes(8 * size))
        self.classes = bytearray(size)
        self.last_age = 0
        self.lru_hit = False

    def observe(self, fp: int, now: int, cls: int) -> int:
        """Follow a reference of ``fp`` of class ``cls`` at ``now``; returns the class of its previous
        reference, or -1 if not followed (see the class docstring). Every sampled reference of the
        policy comes here: the table's heads and counts are read in place (its lists: 0, the
        recent segment, and 1, the older keys), and :meth:`expire` runs only when the oldest key
        passed the horizon."""
        table, times, classes = self.table, self.times, self.classes
        heads, end, counts = table._next, table.capacity, table._counts
        oldest = heads[end + 1]
        if oldest >= end:
            oldest = heads[end]
        if oldest < end and times[oldest] < now - self.horizon:
            self.expire(now)
        entry = table.find(fp)
        if entry >= 0:
            prev = classes[entry]
            self.last_age = now - times[entry]
            self.lru_hit = table._list_of[entry] == 0
            table.move_to_end(entry, 0)
        else:
            prev = -1
            self.lru_hit = False
            if counts[0] + counts[1] >= self.size:  # the oldest key goes, its entry takes fp
                entry = heads[end + 1]
                if entry >= end:
                    entry = heads[end]
                self.model.censor(classes[entry], now - times[entry])
                table.recycle(entry, fp, 0)
            else:
                entry = table.add(fp, 0)
        if counts[0] > self.lru_size:
            table.move_to_end(heads[end], 1)  # the LRU's least recent drops out of it
        times[entry] = now
        classes[entry] = cls
        return prev

    def reclass(self, fp: int, cls: int) -> None:
        """Correct the class of a followed key's last reference."""
        entry = self.table.find(fp)
        if entry >= 0:
            self.classes[entry] = cls

    def expire(self, now: int) -> None:
        """Censor the keys not referenced for ``horizon`` references (the oldest are list 1's head)."""
        table, times = self.table, self.times
        limit = now - self.horizon
        for which in (1, 0):
            entry = table.head(which)
            while entry >= 0 and times[entry] < limit:
                self.model.censor(self.classes[entry], self.horizon)
                table.remove(entry)
                entry = table.head(which)
            if entry >= 0:
                return

    def in_progress(self, now: int) -> tuple[np.ndarray, np.ndarray]:
        """Classes and ages of the keys still followed (censored at their age if solved now)."""
        live = np.frombuffer(self.table._list_of, dtype=np.uint8) != FREE
        ages = now - np.frombuffer(self.times, dtype=np.int64)[live]
        return np.frombuffer(self.classes, dtype=np.uint8)[live], ages

    def clear(self) -> None:
        self.table.clear()


@dataclass
class HoldingPlan:
    """Holding times per class (references), as solved by :meth:`ReturnTimeModel.solve`.

    A reference of class ``c`` holds its block for ``hold[c]``; the one class
    ``partial`` (or -1) holds a ``fraction`` of its references for
    ``extended`` instead. ``learned_hits`` and ``lru_hits`` are the predicted
    hits per reference of this plan and of one holding time for every class
    (the order LRU keeps).
    """

    hold: list[int]
    partial: int = -1
    extended: int = 0
    fraction: float = 0.0
    learned_hits: float = 0.0
    lru_hits: float = 0.0
    observations: float = 0.0
    details: dict[str, float] = field(default_factory=dict)


class ReturnTimeModel:
    """Decayed return-time observations per class over log-spaced ages up to ``horizon``.

    ``prior`` is the weight, in observations, of the pooled curve of all classes
    in each class's curve: a class seen rarely follows the pool.
    """

    def __init__(self, classes: int, horizon: int, *, buckets: int = 40, prior: float = 8.0) -> None:
        if classes <= 0 or horizon <= 0:
            raise ValueError(f"classes and horizon must be positive, got {classes}, {horizon}")
        self.classes = classes
        self.horizon = horizon
        self.prior = prior
        edges = sorted({0, *(round(x) for x in np.geomspace(1, horizon, buckets)), horizon})
        self.edges = np.asarray(edges, dtype=np.float64)
        self._edge_list = edges
        k = len(edges) - 1
        self.events = np.zeros((classes, k))
        self.censored = np.zeros((classes, k))
        self.refs = np.zeros(classes)
        self.elapsed = 0.0
        # New observations land here (Python lists: cheap to bump) until the next solve.
        self._new_events = [0] * (classes * k)
        self._new_censored = [0] * (classes * k)

    def age_bucket(self, age: int) -> int:
        """The bucket ``j`` with ``edges[j] < age <= edges[j + 1]`` (ages beyond the horizon: the last)."""
        j = bisect.bisect_left(self._edge_list, age) - 1
        return min(max(j, 0), len(self._edge_list) - 2)

    def record(self, cls: int, age: int) -> None:
        """A block of class ``cls`` was referenced again ``age`` references after its last one."""
        if 0 < age <= self.horizon:
            self._new_events[cls * (len(self._edge_list) - 1) + self.age_bucket(age)] += 1
        elif age > self.horizon:
            self.censor(cls, self.horizon)

    def censor(self, cls: int, age: int) -> None:
        """A block of class ``cls`` was not referenced again for ``age`` references (then lost from view)."""
        if age > 0:
            self._new_censored[cls * (len(self._edge_list) - 1) + self.age_bucket(age)] += 1

    def solve(
        self,
        capacity: float,
        refs: list[int],
        elapsed: float,
        decay: float,
        in_progress: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> HoldingPlan:
        """Fold in the observations since the last solve and return the best holding times.

        ``refs[c]`` references of class ``c`` happened in the ``elapsed``
        references since the last solve; older statistics are weighted by
        ``decay`` first. ``in_progress`` (classes, ages) are sampled blocks not
        yet seen again, censored at their age for this solve only.
        """
        k = len(self._edge_list) - 1
        shape = (self.classes, k)
        self.events *= decay
        self.censored *= decay
        self.refs *= decay
        self.elapsed = self.elapsed * decay + elapsed
        self.events += np.asarray(self._new_events, dtype=np.float64).reshape(shape)
        self.censored += np.asarray(self._new_censored, dtype=np.float64).reshape(shape)
        self.refs += np.asarray(refs, dtype=np.float64)
        self._new_events = [0] * (self.classes * k)
        self._new_censored = [0] * (self.classes * k)
        censored = self.censored.copy()
        if in_progress is not None and len(in_progress[0]):
            cls, ages = in_progress
            buckets = np.clip(np.searchsorted(self.edges, ages, side="left") - 1, 0, k - 1)
            np.add.at(censored, (cls.astype(np.intp), buckets), 1.0)
        survival = self.survival(self.events, censored)
        return self._allocate(capacity, survival, float(self.events.sum() + censored.sum()))

    def survival(self, events: np.ndarray, censored: np.ndarray) -> np.ndarray:
        """Kaplan-Meier survival per class at each edge, ``(classes, buckets + 1)``, shrunk to the pool."""
        at_risk = (events + censored)[:, ::-1].cumsum(axis=1)[:, ::-1]
        pool_events, pool_risk = events.sum(axis=0), at_risk.sum(axis=0)
        pool_hazard = np.divide(pool_events, pool_risk, out=np.zeros_like(pool_events), where=pool_risk > 0)
        weight = at_risk + self.prior
        hazard = np.divide(events + self.prior * pool_hazard, weight, out=np.zeros_like(events), where=weight > 0)
        survival = np.ones((self.classes, hazard.shape[1] + 1))
        survival[:, 1:] = np.cumprod(1.0 - np.clip(hazard, 0.0, 1.0), axis=1)
        return survival

    def _allocate(self, capacity: float, survival: np.ndarray, observations: float) -> HoldingPlan:
        edges = self.edges
        widths = np.diff(edges)
        space = np.zeros_like(survival)
        space[:, 1:] = np.cumsum(widths * (survival[:, :-1] + survival[:, 1:]) / 2, axis=1)
        hits = 1.0 - survival
        rates = self.refs / self.elapsed if self.elapsed > 0 else np.zeros(self.classes)
        plan = HoldingPlan([0] * self.classes, observations=observations)
        segments: list[tuple[float, int, int, float, float]] = []
        # Python floats from here (the same doubles): a numpy scalar per element costs ten times more.
        rate_of, space_of, hits_of = rates.tolist(), space.tolist(), hits.tolist()
        for c in range(self.classes):
            rate, x, y = rate_of[c], space_of[c], hits_of[c]
            if rate <= 0:
                continue
            for start, end in _upper_hull(x, y):
                d_space = x[end] - x[start]
                d_hits = y[end] - y[start]
                if d_hits <= 0 or d_space <= 0:
                    continue
                segments.append((d_hits / d_space, c, end, rate * d_space, rate * d_hits))
        segments.sort(key=lambda s: -s[0])
        used = gained = 0.0
        for _, c, end, occupancy, gain in segments:
            if used + occupancy <= capacity:
                used += occupancy
                gained += gain
                plan.hold[c] = int(edges[end])
                continue
            plan.partial, plan.extended = c, int(edges[end])
            plan.fraction = (capacity - used) / occupancy
            gained += plan.fraction * gain
            break
        plan.learned_hits = gained
        plan.lru_hits = _uniform_hits(capacity, rates, space, hits)
        plan.details = {"occupancy": used, "capacity": capacity}
        return plan


def _upper_hull(x: Sequence[float], y: Sequence[float]) -> list[tuple[int, int]]:
    """Segments (start, end) of the upper concave hull of points ``(x[i], y[i])`` from point 0."""
    hull: list[int] = [0]
    for i in range(1, len(x)):
        if x[i] <= x[hull[-1]]:
            if y[i] > y[hull[-1]]:
                hull[-1] = i
            continue
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # Drop b if it lies on or below the chord from a to i.
            if (y[b] - y[a]) * (x[i] - x[a]) <= (y[i] - y[a]) * (x[b] - x[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return list(itertools.pairwise(hull))


def _uniform_hits(capacity: float, rates: np.ndarray, space: np.ndarray, hits: np.ndarray) -> float:
    """Predicted hits per reference when every class is held equally long and the cache is full."""
    occupancy = rates @ space  # per edge
    total_hits = rates @ hits
    if occupancy[-1] <= capacity:
        return float(total_hits[-1])
    j = int(np.searchsorted(occupancy, capacity, side="right"))
    if j == 0:
        return 0.0
    lo, hi = occupancy[j - 1], occupancy[j]
    t = 0.0 if hi <= lo else (capacity - lo) / (hi - lo)
    value = total_hits[j - 1] + t * (total_hits[j] - total_hits[j - 1])
    return float(value) if math.isfinite(value) else 0.0
