"""The guard's two tests: a loss past 1 sigma in a few periods, and a small loss sustained over many."""

from __future__ import annotations

from kvtier.policies.return_time.guard import LONG_WARM_UP, SIGMAS, WARM_UP, MeasuredGuard, MiniWheel


def new_guard() -> MeasuredGuard:
    return MeasuredGuard(MiniWheel(size=64, width=16, ring=8, open_at=1 << 40, clock=(1 << 40) - 1))


def period(guard: MeasuredGuard, diffs: list[int]) -> bool:
    """One solve period in which the requests' paired differences (learned minus LRU) were ``diffs``."""
    for diff in diffs:
        guard.chain_diff = diff
        guard.chain_sampled = True
        guard.end_chain()
    return guard.judge()


def noisy(mean: int, spread: int = 10) -> list[int]:
    """A period's requests: differences of +-``spread`` around ``mean`` per pair (paired noise, sigma
    10 per request by default, so about 45 per period of 20 requests)."""
    return [mean + spread, mean - spread] * 10


def test_a_large_loss_falls_back_within_a_few_periods() -> None:
    guard = new_guard()
    fell = [period(guard, noisy(-8)) for _ in range(WARM_UP + 2)]
    assert any(fell) and guard.fallen_back and guard.fallbacks == 1


def test_a_small_sustained_loss_falls_back_once_the_long_run_test_may_act() -> None:
    # -1 a request: 20 a period against a spread of about 90 a period (sigma 20 a request); the fast
    # test's decayed sums (about five periods) stay near -100 against 1 x 200, so only the long-run
    # sums (about 50 periods) see it.
    guard = new_guard()
    fell_at = None
    for i in range(3 * LONG_WARM_UP):
        if period(guard, noisy(-1, 20)):
            fell_at = i
            break
        assert guard.lead >= -SIGMAS * guard.spread
    assert fell_at is not None and fell_at + 1 >= LONG_WARM_UP, fell_at
    assert guard.long_lead < -guard.long_spread
    assert guard.state(learning=True) == "fallen_back"


def test_the_holds_return_only_once_both_windows_lead() -> None:
    guard = new_guard()
    for _ in range(3 * LONG_WARM_UP):
        if period(guard, noisy(-1)):
            break
    assert guard.fallen_back
    # A short run of winning periods turns the fast lead positive, not yet the long-run lead.
    for _ in range(3):
        period(guard, noisy(2))
    assert guard.lead > 0 > guard.long_lead
    assert guard.fallen_back
    for _ in range(4 * LONG_WARM_UP):
        period(guard, noisy(2))
        if not guard.fallen_back:
            break
    assert not guard.fallen_back and guard.long_lead > 0 and guard.lead > 0


def test_a_tie_never_falls_back() -> None:
    guard = new_guard()
    for i in range(10 * LONG_WARM_UP):
        assert not period(guard, noisy(0)), i
    assert guard.fallbacks == 0 and guard.long_lead == 0
