"""The sampled side of return-time against plain models: the sampler's recency list and the guard's miniature.

Both read their :class:`~kvtier.policies.fingerprints.FingerprintLists` in place on the hot path
(heads, counts, the free pool), so these properties pin what they must keep doing: the sampler is
a recency list of at most ``size`` keys whose newest ``lru_size`` are the sampled LRU, censoring
what leaves it; the miniature never holds more than ``size`` keys and makes room by the earliest
expiry.
"""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policies.return_time.guard import MiniWheel
from kvtier.policies.return_time.model import ReturnSampler


class CensorLog:
    """The model collaborator of a sampler: records what it is told is lost from view."""

    def __init__(self) -> None:
        self.censored: list[tuple[int, int]] = []

    def censor(self, cls: int, age: int) -> None:
        self.censored.append((cls, age))


class RecencyModel:
    """What a sampler must do, as plainly as it can be said: keys oldest first, with (time, class)."""

    def __init__(self, size: int, lru_size: int, horizon: int) -> None:
        self.size, self.lru_size, self.horizon = size, lru_size, horizon
        self.keys: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self.censored: list[tuple[int, int]] = []

    def observe(self, fp: int, now: int, cls: int) -> tuple[int, int | None, bool]:
        """(previous class or -1, age of the previous reference or None, sampled-LRU hit)."""
        for old, (then, old_cls) in list(self.keys.items()):  # oldest first: they expire in order
            if then >= now - self.horizon:
                break
            self.censored.append((old_cls, self.horizon))
            del self.keys[old]
        if fp in self.keys:
            hit = fp in self.recent()
            then, prev = self.keys.pop(fp)
            answer = (prev, now - then, hit)
        else:
            if len(self.keys) >= self.size:
                old, (then, old_cls) = next(iter(self.keys.items()))
                self.censored.append((old_cls, now - then))
                del self.keys[old]
            answer = (-1, None, False)
        self.keys[fp] = (now, cls)
        return answer

    def recent(self) -> list[int]:
        """The sampled LRU's keys: the newest ``lru_size``, oldest first."""
        return list(self.keys)[-self.lru_size :]


steps = st.lists(
    st.tuples(st.integers(1, 12), st.integers(0, 40), st.integers(0, 3)),  # key, time step, class
    min_size=1,
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(size=st.integers(1, 6), lru_share=st.integers(1, 6), horizon=st.integers(1, 120), ops=steps)
def test_the_sampler_is_a_bounded_recency_list_whose_newest_keys_are_the_sampled_lru(
    size: int, lru_share: int, horizon: int, ops: list[tuple[int, int, int]]
) -> None:
    lru_size = min(size, lru_share)
    log = CensorLog()
    sampler = ReturnSampler(size, horizon, log, lru_size=lru_size)  # type: ignore[arg-type]
    model = RecencyModel(size, lru_size, horizon)
    now = 0
    for fp, dt, cls in ops:
        now += dt
        prev, age, hit = model.observe(fp, now, cls)
        assert sampler.observe(fp, now, cls) == prev
        assert sampler.lru_hit is hit
        if age is not None:
            assert sampler.last_age == age
        assert log.censored == model.censored, "lost from view in the same order, with the same ages"
        followed = sampler.table.fingerprints(1) + sampler.table.fingerprints(0)
        assert followed == list(model.keys), "one recency list: older keys, then the sampled LRU's"
        assert sampler.table.fingerprints(0) == model.recent()
        assert len(sampler.table) <= size


def list_rank(wheel: MiniWheel, entry: int) -> int:
    """Where an entry's list comes in eviction order: 0 the expired list, then the wheel from its clock."""
    which = wheel.table.list_of(entry)
    return 0 if which == 0 else 1 + (which - 1 - wheel.cur) % wheel.ring


@settings(max_examples=150, deadline=None)
@given(
    size=st.integers(1, 8),
    ops=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 30), st.integers(0, 400)), min_size=1, max_size=150),
)
def test_the_miniature_holds_at_most_its_size_and_makes_room_by_the_earliest_expiry(
    size: int, ops: list[tuple[int, int, int]]
) -> None:
    wheel = MiniWheel(size, width=10, ring=8, open_at=1 << 40, clock=(1 << 40) - 1)
    held: dict[int, int] = {}  # fingerprint -> entry
    now = 0
    for fp, dt, hold in ops:
        now += dt
        if now // wheel.width != wheel.cur:
            wheel.advance(now)
        before = {f: wheel.table.find(f) for f in held}
        ranks = {f: list_rank(wheel, e) for f, e in before.items()}
        wheel.reference(fp, now + hold)
        assert wheel.holds(fp)
        gone = [f for f in held if not wheel.holds(f)]
        if fp in held or len(held) < size:
            assert not gone, "nothing leaves a miniature with room"
        else:
            assert len(gone) == 1, "a full miniature makes room for one key by evicting one"
            assert ranks[gone[0]] == min(ranks.values()), "the victim is of the earliest list in eviction order"
            del held[gone[0]]
        held[fp] = wheel.table.find(fp)
        assert len(wheel) == len(held) <= size
