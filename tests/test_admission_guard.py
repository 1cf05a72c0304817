"""The measured guard of ``admission: learned`` (issue 21, item 4; kvtier.manager.admission_guard):
the hits the rule gains and loses against writing every store, counted on the same stream
whichever the tier follows; it falls back to writing everything when the rule loses, and
resumes when it gains."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import Namespace, RequestContext, TieringManager, prefix_keys
from kvtier.keys import KVGeometry
from kvtier.manager import admission_guard
from kvtier.manager.admission import LearnedAdmission
from kvtier.manager.admission_guard import ADMITTED, DECLINED, ENDED, MIN_EVIDENCE, OVERRIDDEN, ReturnWatch
from kvtier.metrics import KvtierMetrics
from kvtier.policies.lru import LRUPolicy
from kvtier.tiers.memory import MemoryTier
from request_flow import serve

SMALL = Namespace("admission-guard-test", KVGeometry.from_block_bytes(64, tokens_per_block=16))


def _keys(n: int, salt: int = 0) -> list[bytes]:
    return [bytes(prefix_keys(np.asarray([salt, i]), 1)[-1]) for i in range(n)]


def test_a_declined_block_back_within_the_horizon_is_a_hit_lost_and_an_admitted_one_kept_longer_a_hit_gained() -> (
    None
):
    watch = ReturnWatch(horizon=10)  # a small horizon: every key is followed
    assert watch.sampled_share == 1.0 and watch.state == "learning"
    declined, admitted, filler = _keys(1, 1), _keys(1, 2), _keys(40, 3)
    watch.stored(declined, DECLINED)
    watch.stored(admitted, ADMITTED)
    watch.stored(filler[:5], ADMITTED)
    watch.stored(declined, ADMITTED)  # back after 7 offered blocks: writing everything kept it
    assert (watch.gained, watch.lost) == (0.0, 1.0)
    watch.stored(filler[5:25], DECLINED)  # 20 more offered, none written
    watch.served(admitted)  # 6 admitted since, 27 offered: only the rule kept it
    assert (watch.gained, watch.lost) == (1.0, 1.0)
    watch.served(admitted)  # used again at once: a hit in both worlds, nothing either way
    watch.stored(filler[25:36], ADMITTED)  # 11 written: past the horizon in both worlds
    watch.served(admitted)
    assert (watch.gained, watch.lost) == (1.0, 1.0)
    written_anyway = _keys(2, 4)
    watch.stored(written_anyway, OVERRIDDEN)  # what the rule declines, written because the guard fell back
    watch.served(written_anyway[:1])  # served: a hit only because it was written
    watch.stored(written_anyway[1:], ADMITTED)  # stored again: the tier lost it too, nothing either way
    assert (watch.gained, watch.lost) == (1.0, 2.0)
    ended = _keys(1, 5)
    clocks = (watch.admitted_clock, watch.offered_clock)
    watch.stored(ended, ENDED)  # the hints' decline: not the rule's, not followed, not offered
    watch.stored(ended, ADMITTED)
    assert (watch.gained, watch.lost) == (1.0, 2.0) and watch.offered_clock == clocks[1] + 1
    watch.fallen_back = True  # writing everything: what the tier missed is judged for the rule
    kept_by_the_rule, pushed_out = _keys(2, 13)
    watch.stored([kept_by_the_rule, pushed_out], ADMITTED)
    watch.stored(filler[:4], OVERRIDDEN)
    watch.stored([kept_by_the_rule], ADMITTED)  # the tier lost it; 0 admitted since: the rule kept it
    watch.stored(filler[4:16], ADMITTED)
    watch.stored([pushed_out], ADMITTED)  # 13 admitted since: the rule lost it too
    assert (watch.gained, watch.lost) == (2.0, 2.0)
    watch.fallen_back = False
    shared = _keys(1, 12)
    watch.stored(shared, DECLINED)
    watch.served(shared)  # another engine sharing the tier wrote it: declining it here cost nothing
    assert (watch.gained, watch.lost) == (2.0, 2.0)


def test_a_use_in_the_cpu_tier_renews_a_blocks_stay_in_both_worlds() -> None:
    """The CPU tier's hits touch the tier (their recency there): a block touched is followed from
    then, like one just written."""
    watch = ReturnWatch(horizon=10)
    admitted, written_anyway = _keys(1, 14), _keys(1, 15)
    filler = _keys(40, 16)
    watch.stored(admitted, ADMITTED)
    watch.stored(written_anyway, OVERRIDDEN)
    watch.stored(filler[:8], DECLINED)
    watch.touched(admitted + written_anyway)
    watch.stored(filler[8:16], DECLINED)  # 16 offered since the stores, 8 since the touch
    watch.served(admitted)  # writing everything would have kept it too (touched): nothing gained
    watch.served(written_anyway)  # written only because the guard fell back, kept by its touch: lost
    assert (watch.gained, watch.lost) == (0.0, 1.0)


def test_the_guard_falls_back_when_the_rule_loses_and_resumes_when_it_gains() -> None:
    watch = ReturnWatch(horizon=1000)
    losing = _keys(MIN_EVIDENCE, 6)
    for key in losing:
        watch.stored([key], DECLINED)
        watch.stored([key], ADMITTED)  # back at once: lost
    assert watch.fallen_back and watch.state == "fallen_back" and watch.fallbacks == 1
    gaining = _keys(4 * MIN_EVIDENCE, 7)
    for i, key in enumerate(gaining):
        watch.stored([key], ADMITTED)
        watch.stored(_keys(1001, 100 + i), OVERRIDDEN)  # more than the horizon written, nothing admitted
        watch.stored([key], ADMITTED)  # writing everything lost it; the rule would have kept it
        if not watch.fallen_back:
            break
    assert not watch.fallen_back and watch.state == "judging" and watch.fallbacks == 1
    assert watch.gained > watch.lost


def test_a_close_count_changes_nothing() -> None:
    """Within two standard deviations either way the guard stays as it is."""
    watch = ReturnWatch(horizon=1000)
    for i, key in enumerate(_keys(2 * MIN_EVIDENCE, 8)):
        if i % 2:
            watch.stored([key], DECLINED)
            watch.stored([key], ADMITTED)
        else:
            watch.stored([key], ADMITTED)
            watch.stored(_keys(1001, 200 + i), DECLINED)
            watch.served([key])
    for key in _keys(4, 9):  # a few more lost than gained: within the noise
        watch.stored([key], DECLINED)
        watch.stored([key], ADMITTED)
    assert watch.lost == watch.gained + 4 == MIN_EVIDENCE + 4
    assert watch.state == "judging" and watch.fallbacks == 0


def test_only_a_sample_of_a_long_horizon_is_followed_and_memory_stays_bounded() -> None:
    watch = ReturnWatch(horizon=1 << 20)
    assert 0 < watch.sampled_share < 0.01
    keys = _keys(60_000, 9)
    for start in range(0, len(keys), 16):
        watch.stored(keys[start : start + 16], DECLINED)
    followed = len(watch._declined)
    assert 0 < followed <= admission_guard.SAMPLED_MAX
    assert abs(followed - len(keys) * watch.sampled_share) < 0.5 * len(keys) * watch.sampled_share


class _Model:
    """The guard, computed plainly: every return is judged by both clocks as the module docstring
    says, nothing is ever forgotten (what the guard forgets can no longer count either way), the
    state is decided from the counts after each one."""

    def __init__(self, horizon: int) -> None:
        self.horizon = horizon
        self.admitted_clock = self.offered_clock = 0
        self.follow: dict[bytes, tuple[str, int, int]] = {}
        self.gained = self.lost = 0
        self.fallen_back = False

    def count(self, gained: int, lost: int) -> None:
        self.gained += gained
        self.lost += lost
        total, difference = self.gained + self.lost, self.lost - self.gained
        if total >= MIN_EVIDENCE and difference * difference > 4 * total:
            self.fallen_back = difference > 0

    def back(self, key: bytes, served: bool) -> None:
        kind, a, t = self.follow.pop(key, ("", 0, 0))
        kept_by_rule = self.admitted_clock - a <= self.horizon
        kept_by_all = self.offered_clock - t <= self.horizon
        if kind == "admitted":
            self.count(int(kept_by_rule and (not served if self.fallen_back else served and not kept_by_all)), 0)
        elif kind == "overridden":
            self.count(0, int(served and kept_by_all))
        elif kind == "declined":
            self.count(0, int(not served and kept_by_all))

    def stored(self, keys: list[bytes], outcome: int) -> None:
        self.admitted_clock += len(keys) if outcome == ADMITTED else 0
        self.offered_clock += len(keys) if outcome != ENDED else 0
        for key in keys:
            self.back(key, served=False)
            if outcome != ENDED:
                kind = {ADMITTED: "admitted", DECLINED: "declined", OVERRIDDEN: "overridden"}[outcome]
                self.follow[key] = (kind, self.admitted_clock, self.offered_clock)

    def served(self, keys: list[bytes]) -> None:
        for key in keys:
            self.back(key, served=True)
            self.follow[key] = ("admitted", self.admitted_clock, self.offered_clock)

    def touched(self, keys: list[bytes]) -> None:
        """A use renews the stay of a block still in the tier (of its world), not of one gone."""
        for key in keys:
            kind, a, t = self.follow.get(key, ("", 0, 0))
            age = {"admitted": self.admitted_clock - a, "overridden": self.offered_clock - t}.get(kind)
            if age is not None and age <= self.horizon:
                self.follow[key] = (kind, self.admitted_clock, self.offered_clock)


POOL = _keys(8, 10)
OUTCOMES = [ADMITTED, DECLINED, OVERRIDDEN, ENDED]
KEYS = st.lists(st.sampled_from(POOL), min_size=1, max_size=4, unique=True)
steps = st.lists(st.tuples(st.sampled_from(["stored", "served", "touched"]), KEYS, st.sampled_from(OUTCOMES)),
                 max_size=200)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(horizon=st.integers(1, 40), fallen_back=st.booleans(), steps=steps)
def test_the_guard_counts_what_a_plain_model_counts(
    horizon: int, fallen_back: bool, steps: list[tuple[str, list[bytes], int]]
) -> None:
    watch, model = ReturnWatch(horizon), _Model(horizon)
    watch.fallen_back = model.fallen_back = fallen_back  # (a start in either state: few examples reach one)
    for op, keys, outcome in steps:
        if op == "stored":
            watch.stored(keys, outcome)
            model.stored(keys, outcome)
        elif op == "served":
            watch.served(keys)
            model.served(keys)
        else:
            watch.touched(keys)
            model.touched(keys)
        assert (watch.admitted_clock, watch.offered_clock) == (model.admitted_clock, model.offered_clock)
        assert (watch.gained, watch.lost) == (model.gained, model.lost)  # far below the window: no halving
        assert watch.fallen_back == model.fallen_back
        assert len(watch._admitted) + len(watch._declined) <= len(POOL)


# --- through the admission and the manager --------------------------------------------------------


class _Declines:
    """The CPU tier as the admission sees it (a collaborator): every store predicted a tenth as
    likely to return as the average."""

    policy: Any

    def __init__(self) -> None:
        self.policy = self

    def slot_of(self, key: bytes) -> int:
        return 0

    def relative_reuse(self, tail_slot: int, horizon: int) -> float:
        return 0.1


def test_while_fallen_back_the_rules_declines_are_written_and_a_request_keeps_its_outcome() -> None:
    admission = LearnedAdmission(_Declines(), 1000, None)  # type: ignore[arg-type]
    keys = _keys(8, 11)
    first = RequestContext("before")
    assert not admission.admit(keys[:4], first, 0) and admission.declined == 4
    admission.watch.fallen_back = True  # (what the counts above decide; tested on their own)
    later = RequestContext("after")
    assert admission.admit(keys[4:6], later, 0) and admission.overridden == 2
    assert admission.admit(keys[6:], later, 0) and admission.overridden == 4  # its later piece follows
    assert not admission.admit(keys[:2], first, 0)  # a request judged before keeps its outcome
    admission.watch.fallen_back = False
    assert admission.admit(keys[6:], later, 0)  # and so does one overridden


class AlwaysUnlikely(LRUPolicy):
    """An eviction policy whose admission predictions are wrong for the test's workload: every
    store is predicted a tenth as likely to return as the average (imported by path)."""

    def relative_reuse(self, tail_slot: int, horizon: int) -> float:
        return 0.1


def _serve_prompts(mgr: TieringManager, prompts: list[list[bytes]], rounds: int) -> None:
    n = 0
    for _ in range(rounds):
        for keys in prompts:
            serve(mgr, RequestContext(f"r{n}"), keys)
            n += 1


@pytest.mark.usefixtures("shm_leak_check")
def test_a_rule_that_declines_what_returns_is_overridden_through_the_manager() -> None:
    """Sixteen 8-block prompts in turn: each comes back after 120 other blocks, long gone from the
    32-block CPU tier and well inside the 256-block tier. Predicted not to return, every store is
    declined and every return recomputed, until the guard has counted enough of those hits lost:
    it falls back, the stores are written, and the returns are served by the tier."""
    spec = {"type": "memory", "admission": "learned", "max_bytes": 256 * MemoryTier.bytes_per_block(64)}
    mgr = TieringManager.create(namespace=SMALL, num_cpu_blocks=32, policy=f"{__name__}:AlwaysUnlikely",
                                tiers=[spec])  # fmt: skip
    try:
        prompts = [[bytes(k) for k in prefix_keys(np.asarray([p * 100 + i for i in range(8)]), 1)] for p in range(16)]
        _serve_prompts(mgr, prompts, rounds=6)
        snap = mgr.stats()
        admission = snap.tier("1:memory").admission
        assert admission is not None and admission.guard == "fallen_back" and admission.guard_fallbacks == 1
        assert admission.hits_lost >= MIN_EVIDENCE and admission.hits_gained == 0
        assert admission.learned_declined > 0 and admission.overridden_blocks > 0
        assert snap.tier("1:memory").lookups.hit > 0  # the returns after the fallback
        metrics = KvtierMetrics()
        metrics.update(snap)
        text = metrics.render().decode()
        assert 'kvtier_admission_guard_state{state="fallen_back",tier="1:memory"} 1.0' in text
        assert 'kvtier_admission_guard_fallbacks_total{tier="1:memory"} 1.0' in text
        overridden = float(admission.overridden_blocks)
        assert f'kvtier_admission_overridden_blocks_total{{tier="1:memory"}} {overridden}' in text
        assert 'kvtier_admission_guard_hits{effect="lost",tier="1:memory"}' in text
    finally:
        mgr.shutdown()
