"""Every wait has an end (issue 20, class 10): no lookup keeps a request waiting on one block longer
than ``wait_timeout``, a tier whose promise for a block failed is not believed about it for
``failed_load_seconds``, a tier with a job in flight past the deadline gets no lookups or
cascades, parked request-level cascades expire, and ``reset_cache`` never hangs on one tier.

The manager is real (a real region, the real CPU tier); its collaborators are the scripted tiers
of ``tier_doubles`` (jobs finish when the test says so, loads fail for chosen keys, lookups answer
RETRY for chosen keys) and the bundled memory tier. Time is real: waits of a few tenths of a second.
Real fs, Redis and S3 tiers: ``tests/tiers/test_manager_waits_tiers.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import tier_doubles
from kvtier import LookupResult, Namespace, RequestContext, TieringManager, prefix_keys
from kvtier.config import load_config
from kvtier.errors import ConfigError, TierDrainTimeout
from kvtier.metrics import KvtierMetrics
from kvtier.primary import IN_FLIGHT
from kvtier.tiers.registry import register_tier
from tier_doubles import ScriptedTier, wait_for_answer

pytestmark = pytest.mark.usefixtures("shm_leak_check")
register_tier("scripted", "tier_doubles:ScriptedTier")

HIT, HIT_PENDING, RETRY, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY, LookupResult.MISS
WAIT = 0.3
HOLD = 1.0
STEP = 0.01  # seconds between two engine steps in these tests


@pytest.fixture
def make(namespace: Namespace) -> Iterator[Any]:
    built: list[TieringManager] = []

    def factory(*tier_options: dict[str, Any], blocks: int = 8, **settings: Any) -> TieringManager:
        specs = [{"type": "scripted", **o} for o in tier_options]
        settings = {"wait_timeout": WAIT, "failed_load_seconds": HOLD, **settings}
        mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=blocks, tiers=specs, **settings)
        built.append(mgr)
        return mgr

    yield factory
    for mgr in built:
        for tier in mgr.tiers:
            if isinstance(tier, ScriptedTier):
                tier.auto_complete = True
                tier.complete_all()
        mgr.shutdown()


def keys(n: int, seed: int = 0) -> list[bytes]:
    return prefix_keys(np.arange(n * 4) + seed * 100_000, 4)


def scripted(mgr: TieringManager) -> list[ScriptedTier]:
    return [t for t in mgr.tiers if isinstance(t, ScriptedTier)]


def wait_for(mgr: TieringManager, key: bytes, req: RequestContext, limit: float) -> tuple[LookupResult, float]:
    return wait_for_answer(mgr, key, req, limit, STEP)


def failures(mgr: TieringManager, label: str) -> dict[str, int]:
    return dict(mgr.stats().tier(label).failures)


# --- HIT_PENDING ---------------------------------------------------------------------------


def test_a_load_that_never_finishes_ends_as_a_miss_at_the_deadline(make: Any) -> None:
    mgr = make({"auto_complete": False})
    (tier,) = scripted(mgr)
    k, other = keys(2)
    tier.data[k] = tier.data[other] = b"v" * mgr.block_bytes
    req = RequestContext("r")
    assert mgr.lookup(k, req) is HIT_PENDING
    answer, waited = wait_for(mgr, k, req, limit=10 * WAIT)
    assert answer is MISS and WAIT <= waited < WAIT + 0.5, f"{answer} after {waited:.2f}s"
    assert mgr.lookup(k, RequestContext("later")) is MISS, "a later request does not wait on it either"
    # The row stays reserved for the job (the tier may still write it) ...
    assert mgr.primary.ref_count(k) == IN_FLIGHT
    # ... and the tier, whose job is overdue (wait_timeout after it was submitted, at the step
    # end after the lookup), is asked nothing: no other request waits on it.
    time.sleep(2 * STEP)
    mgr.on_schedule_end()
    assert mgr.lookup(other, req) is MISS and len(tier.queued) == 1
    snap = mgr.stats().tier("1:scripted")
    assert snap.failures["load_expired"] == 1 and snap.failures["job_overdue"] == 1
    tier.complete_all()  # the load finally ends: the block is there, the tier serves again
    mgr.on_schedule_end()
    assert mgr.lookup(k, req) is HIT
    assert mgr.lookup(other, req) is HIT_PENDING


def test_a_load_that_keeps_failing_is_not_promised_again(make: Any) -> None:
    """The tier keeps answering HIT for a block it cannot load (an S3 timeout, an unreadable
    file): after one failed load the block is a MISS at once, until failed_load_seconds passed."""
    mgr = make({})
    (tier,) = scripted(mgr)
    k = keys(1)[0]
    tier.data[k] = b"v" * mgr.block_bytes
    tier.fail_keys = {k}
    req = RequestContext("r")
    loads_before = sum(1 for _, call in tier_doubles.CALLS if call == "submit_load")
    answers = [mgr.lookup(k, req)]
    for _ in range(5):
        mgr.on_schedule_end()
        answers.append(mgr.lookup(k, req))
    assert answers == [HIT_PENDING] + [MISS] * 5, answers
    assert failures(mgr, "1:scripted")["withheld"] == 5
    assert sum(1 for _, call in tier_doubles.CALLS if call == "submit_load") == loads_before + 1
    time.sleep(HOLD)  # then the tier is believed again (it may have re-verified the block)
    tier.fail_keys = set()
    assert mgr.lookup(k, req) is HIT_PENDING
    mgr.on_schedule_end()
    assert mgr.lookup(k, req) is HIT


def test_a_refused_load_is_not_promised_again(make: Any) -> None:
    mgr = make({})
    (tier,) = scripted(mgr)
    k = keys(1)[0]
    tier.data[k] = b"v" * mgr.block_bytes

    def refuse(job: Any) -> None:
        raise RuntimeError("load queue gone")

    tier.submit_load = refuse  # type: ignore[method-assign]
    req = RequestContext("r")
    assert mgr.lookup(k, req) is HIT_PENDING
    mgr.on_schedule_end()
    assert [mgr.lookup(k, req) for _ in range(3)] == [MISS] * 3


def test_a_device_store_never_completed_ends_as_a_miss_at_the_deadline(make: Any) -> None:
    mgr = make()
    k = keys(1)[0]
    result = mgr.prepare_store([k], RequestContext("writer"))  # the engine never completes it
    assert result is not None
    req = RequestContext("reader")
    answer, waited = wait_for(mgr, k, req, limit=10 * WAIT)
    assert answer is MISS and WAIT <= waited < WAIT + 0.5, f"{answer} after {waited:.2f}s"
    assert failures(mgr, "0:primary")["store_expired"] == 1
    mgr.complete_store([k], RequestContext("writer"))
    assert mgr.lookup(k, req) is HIT


@pytest.mark.parametrize("tiers", [(), ({"auto_complete": False},)], ids=["device store", "retry"])
def test_the_deadline_holds_when_the_engine_steps_less_often_than_wait_timeout(
    make: Any, tiers: tuple[dict[str, Any], ...]
) -> None:
    """Regression (review, 2026-12-03): a block's clock restarted whenever its last answer was
    older than ``wait_timeout``, so an engine stepping every 0.1 s with ``wait_timeout`` 0.05 s
    got HIT_PENDING (or RETRY) forever."""
    mgr = make(*tiers, wait_timeout=0.05)
    k = keys(1)[0]
    if tiers:
        (tier,) = scripted(mgr)
        tier.retry_keys = {k}  # its existence check never ends
    else:
        assert mgr.prepare_store([k], RequestContext("writer")) is not None  # never completed
    req = RequestContext("reader")
    answers = []
    for _ in range(4):
        answers.append(mgr.lookup(k, req))
        mgr.on_schedule_end()
        time.sleep(0.1)
    assert answers[0] in (HIT_PENDING, RETRY) and answers[1:] == [MISS] * 3, answers


def test_a_wait_that_ended_in_a_miss_is_not_inherited_by_a_later_request(make: Any) -> None:
    """Regression (review, 2026-12-03): a block's clock outlived a wait that ended in a MISS (the
    tier's check found nothing), so a request asking between wait_timeout and failed_load_seconds
    later got MISS at once, a ``retry_expired`` failure, and the tier withheld for the block."""
    mgr = make({})
    (tier,) = scripted(mgr)
    k = keys(1)[0]

    def ask(who: str) -> LookupResult:
        answer = mgr.lookup(k, RequestContext(who))
        mgr.on_schedule_end()
        return answer

    tier.retry_keys = {k}
    assert ask("a") is RETRY  # the tier checks whether it holds the block...
    tier.retry_keys = set()
    assert ask("a") is MISS  # ...it does not: request a recomputes it
    time.sleep(2 * WAIT)  # within HOLD; another engine stores the block meanwhile
    tier.data[k] = b"v" * mgr.block_bytes
    tier.retry_keys = {k}
    assert ask("b") is RETRY
    tier.retry_keys = set()
    assert ask("b") is HIT_PENDING
    assert not {kind: n for kind, n in failures(mgr, "1:scripted").items() if n}


def test_a_device_store_started_after_a_miss_is_waited_on_afresh(make: Any) -> None:
    mgr = make({})
    (tier,) = scripted(mgr)
    k = keys(1)[0]
    tier.retry_keys = {k}
    assert mgr.lookup(k, RequestContext("a")) is RETRY
    tier.retry_keys = set()
    assert mgr.lookup(k, RequestContext("a")) is MISS
    time.sleep(2 * WAIT)
    assert mgr.prepare_store([k], RequestContext("a")) is not None  # a recomputed it; its store starts
    assert mgr.lookup(k, RequestContext("b")) is HIT_PENDING
    assert failures(mgr, "0:primary").get("store_expired", 0) == 0


def test_one_wait_goes_on_across_tiers(make: Any) -> None:
    """A load from tier 1 fails half way to the deadline; tier 2 holds the block too but never
    finishes its load: the request's wait still ends at the deadline, not half a deadline later."""
    mgr = make({"auto_complete": False}, {"auto_complete": False})
    first, second = scripted(mgr)
    k = keys(1)[0]
    first.data[k] = second.data[k] = b"v" * mgr.block_bytes
    first.fail_keys = {k}
    req = RequestContext("r")
    start = time.monotonic()
    assert mgr.lookup(k, req) is HIT_PENDING and mgr.promoted_from == 1
    mgr.on_schedule_end()
    time.sleep(WAIT / 2)
    first.complete_all()
    mgr.on_schedule_end()
    assert mgr.lookup(k, req) is HIT_PENDING and mgr.promoted_from == 2
    answer, _ = wait_for(mgr, k, req, limit=10 * WAIT)
    waited = time.monotonic() - start
    assert answer is MISS and waited < WAIT + 0.2, f"{answer} after {waited:.2f}s in all"


# --- RETRY -------------------------------------------------------------------------------------


def test_a_tier_that_answers_retry_forever_ends_as_a_miss_at_the_deadline(make: Any) -> None:
    mgr = make({}, {})
    first, second = scripted(mgr)
    k = keys(1)[0]
    first.retry_keys = second.retry_keys = {k}
    req = RequestContext("r")
    answer, waited = wait_for(mgr, k, req, limit=10 * WAIT)
    assert answer is MISS and WAIT <= waited < WAIT + 0.5, f"{answer} after {waited:.2f}s"
    # Both tiers are not believed about it for a while: no new wait starts at once.
    assert [mgr.lookup(k, req) for _ in range(3)] == [MISS] * 3
    assert failures(mgr, "1:scripted")["retry_expired"] == 1 and failures(mgr, "2:scripted")["retry_expired"] == 1
    time.sleep(HOLD)
    first.retry_keys = second.retry_keys = set()
    first.data[k] = b"v" * mgr.block_bytes
    assert mgr.lookup(k, req) is HIT_PENDING


def test_a_retry_then_a_promotion_is_one_wait(make: Any) -> None:
    mgr = make({"auto_complete": False})
    (tier,) = scripted(mgr)
    k = keys(1)[0]
    tier.retry_keys = {k}
    req = RequestContext("r")
    start = time.monotonic()
    assert mgr.lookup(k, req) is RETRY
    time.sleep(WAIT * 0.6)
    tier.retry_keys = set()
    tier.data[k] = b"v" * mgr.block_bytes
    assert mgr.lookup(k, req) is HIT_PENDING  # the load never finishes
    answer, _ = wait_for(mgr, k, req, limit=10 * WAIT)
    assert answer is MISS and time.monotonic() - start < WAIT + 0.2


# --- jobs past the deadline, parked cascades --------------------------------------------------


def test_a_tier_whose_cascade_never_finishes_gets_no_more_cascades(make: Any, caplog: Any) -> None:
    mgr = make({"auto_complete": False}, {})
    stuck, healthy = scripted(mgr)
    first, later = keys(1), keys(2, seed=1)
    req = RequestContext("r")
    result = mgr.prepare_store(first, req)
    assert result is not None
    mgr.complete_store(first, req)
    assert mgr.primary.ref_count(first[0]) == 2  # one pin per tier's cascade
    mgr.on_schedule_end()
    time.sleep(WAIT + 0.05)
    with caplog.at_level(logging.WARNING, logger="kvtier.manager"):
        result = mgr.prepare_store(later, req)  # the step's poll finds the cascade overdue
    assert any("not reported within the wait deadline" in r.getMessage() for r in caplog.records)
    assert result is not None
    mgr.complete_store(later, req)
    assert len(stuck.queued) == 1, "no new cascade goes to the tier whose cascade is overdue"
    assert set(healthy.data) == {*first, *later}
    assert mgr.primary.ref_count(first[0]) == 1, "its pin stays: the tier may still be reading the row"
    assert failures(mgr, "1:scripted")["job_overdue"] == 1
    stuck.complete_all()
    mgr.on_schedule_end()
    mgr.on_schedule_end()  # the next step's poll sees the report
    assert mgr.primary.ref_count(first[0]) == 0
    more = keys(1, seed=2)
    result = mgr.prepare_store(more, req)
    assert result is not None
    mgr.complete_store(more, req)
    assert more[0] in stuck.data or any(more[0] in job.keys for job in stuck.queued), "cascades resume"


def test_a_parked_request_level_cascade_expires(make: Any) -> None:
    """A request-level tier's cascade waits for its block's write; a write that never ends must not
    keep the request (and has_pending_work) alive forever."""
    mgr = make({"request_level": True})
    (tier,) = scripted(mgr)
    k = keys(1)[0]
    assert mgr.prepare_store([k], RequestContext("writer")) is not None  # never completed
    req = RequestContext("request-level")
    mgr.on_new_request(req)
    assert mgr.prepare_store([k], req) is not None
    mgr.on_request_finished(req)
    mgr.on_schedule_end()
    assert mgr.has_pending_work() and tier.finished_requests == []
    deadline = time.monotonic() + 10 * WAIT
    while mgr.has_pending_work() and time.monotonic() < deadline:
        time.sleep(STEP)
        mgr.on_schedule_end()
    assert not mgr.has_pending_work()
    assert tier.finished_requests == ["request-level"]
    assert failures(mgr, "1:scripted")["cascade_expired"] == 1


# --- reset_cache -------------------------------------------------------------------------------


class _HangingDrain(ScriptedTier):
    """A tier whose ``drain()`` ignores its timeout and blocks until ``release`` is set."""

    tier_type = "hanging-drain"

    def __init__(self, context: Any, **options: Any) -> None:
        super().__init__(context, **options)
        self.release = threading.Event()
        self.drain_calls = 0

    def drain(self, timeout: float | None = None) -> None:
        self.drain_calls += 1
        self.release.wait()
        self.complete_all()


register_tier("hanging-drain", f"{__name__}:_HangingDrain")


def test_reset_cache_never_hangs_on_a_tier_whose_drain_does_not_return(namespace: Namespace) -> None:
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=4, tiers=[{"type": "hanging-drain"}])
    (tier,) = mgr.tiers
    assert isinstance(tier, _HangingDrain)
    k = keys(1)[0]
    assert mgr.prepare_store([k], RequestContext("r")) is not None
    mgr.complete_store([k], RequestContext("r"))
    outcome: list[BaseException | None] = []

    def reset() -> None:
        try:
            mgr.reset_cache(drain_timeout=0.2)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=reset, daemon=True)
    caller.start()
    caller.join(5.0)
    try:
        assert not caller.is_alive(), "reset_cache() hangs while a tier's drain() does not return"
        assert isinstance(outcome[0], TierDrainTimeout) and "did not return from drain()" in str(outcome[0])
        assert mgr.lookup(k, RequestContext("r")) is HIT, "nothing was reset"
        tier.release.set()
        mgr.reset_cache(drain_timeout=5.0)  # waits for the drain still running, never calls it twice
        assert tier.drain_calls == 1 and len(mgr.primary) == 0
    finally:
        tier.release.set()
        mgr.shutdown()


class _SlowDrain(ScriptedTier):
    """A tier whose ``drain(timeout)`` takes ``seconds`` (then finishes), or raises at its timeout."""

    tier_type = "slow-drain"

    def __init__(self, context: Any, seconds: float = 0.0, **options: Any) -> None:
        super().__init__(context, **options)
        self.seconds = seconds

    def drain(self, timeout: float | None = None) -> None:
        if timeout is not None and timeout < self.seconds:
            time.sleep(timeout)
            raise TierDrainTimeout(f"{self.label}: jobs still in flight after {timeout}s")
        time.sleep(self.seconds)
        self.complete_all()


register_tier("slow-drain", f"{__name__}:_SlowDrain")


def test_the_drain_timeout_is_shared_by_the_tiers(namespace: Namespace) -> None:
    tiers = [{"type": "slow-drain", "seconds": 0.3}, {"type": "slow-drain", "seconds": 10.0}]
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=4, tiers=tiers)
    try:
        start = time.monotonic()
        with pytest.raises(TierDrainTimeout):
            mgr.reset_cache(drain_timeout=0.5)
        assert time.monotonic() - start < 0.5 + 0.3, "each tier waited the whole timeout"
    finally:
        mgr.shutdown()


# --- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["wait_timeout", "failed_load_seconds"])
@pytest.mark.parametrize(
    "value", [float("inf"), float("nan"), -1.0, 0, 1e400, 10**401, True, "5", None, 1e9, [1]], ids=repr
)
def test_bad_wait_settings_are_refused_by_name(namespace: Namespace, private_shm: Any, name: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=name):
        TieringManager.create(namespace=namespace, num_cpu_blocks=4, shm_dir=private_shm, **{name: value})
    with pytest.raises(ConfigError, match=name):
        TieringManager(None, **{name: value})  # type: ignore[arg-type]  # checked before the parts are used
    assert not list(private_shm.iterdir()), "refused before the region was created"


@pytest.mark.parametrize("name", ["wait_timeout", "failed_load_seconds"])
@pytest.mark.parametrize("text", ["inf", "nan", "-1", "0", "1e400", "1" + "0" * 400, "abc", "1e9", "10 s"])
def test_bad_wait_settings_from_the_environment_are_refused_by_name(name: str, text: str) -> None:
    with pytest.raises(ConfigError, match=f"{name}.*KVTIER_{name.upper()}"):
        load_config(None, env={f"KVTIER_{name.upper()}": text}, cli={})


def test_wait_settings_from_a_file_the_environment_and_flags(tmp_path: Any) -> None:
    path = tmp_path / "kv.yaml"
    path.write_text("wait_timeout: 4\nfailed_load_seconds: 60\nnum_cpu_blocks: 4\n")
    config = load_config(str(path), env={"KVTIER_WAIT_TIMEOUT": "2.5"}, cli={"failed_load_seconds": "90"})
    assert (config.wait_timeout, config.failed_load_seconds) == (2.5, 90.0)
    assert config.sources["wait_timeout"] == "environment variable KVTIER_WAIT_TIMEOUT"
    defaults = load_config(None, env={}, cli={})
    assert (defaults.wait_timeout, defaults.failed_load_seconds) == (10.0, 30.0)


def test_the_defaults_end_a_wait_within_ten_seconds(namespace: Namespace) -> None:
    with TieringManager.create(namespace=namespace, num_cpu_blocks=4) as mgr:
        assert mgr.wait_timeout == 10.0


# --- metrics --------------------------------------------------------------------------------------


def test_expired_waits_and_withheld_answers_reach_prometheus(make: Any) -> None:
    mgr = make({})
    (tier,) = scripted(mgr)
    k, r = keys(2)
    tier.data[k] = b"v" * mgr.block_bytes
    tier.fail_keys = {k}
    tier.retry_keys = {r}
    req = RequestContext("r")
    assert mgr.lookup(k, req) is HIT_PENDING
    mgr.on_schedule_end()
    assert mgr.lookup(k, req) is MISS
    assert wait_for(mgr, r, req, limit=10 * WAIT)[0] is MISS
    metrics = KvtierMetrics()
    metrics.update(mgr)
    text = metrics.render().decode()
    for kind in ("withheld", "retry_expired", "promotion_job_failed"):
        assert f'kvtier_failures_total{{kind="{kind}",tier="1:scripted"}} 1.0' in text, kind


def test_a_promotion_joining_an_old_batch_in_a_long_step_begins_its_own_wait(make: Any) -> None:
    """Regression (found by the stateful test, 2026-12-02): a block whose promotion joined a batch
    queued earlier in the same (long) step inherited the batch's clock, so its second lookup,
    right after the first, already answered MISS."""
    mgr = make({"auto_complete": False})
    (tier,) = scripted(mgr)
    a, b = keys(2)
    tier.data[a] = tier.data[b] = bytes(mgr.block_bytes)
    req = RequestContext("r")
    mgr.on_new_request(req)
    assert mgr.lookup(a, req) is LookupResult.HIT_PENDING  # the batch of (tier, request) begins
    time.sleep(WAIT * 1.5)  # the step goes on: no step end
    assert mgr.lookup(b, req) is LookupResult.HIT_PENDING  # joins the batch: its wait begins now
    assert mgr.lookup(b, req) is LookupResult.HIT_PENDING
    assert mgr.lookup(a, req) is LookupResult.MISS  # a's own wait is past the deadline


def test_a_promotion_never_extends_a_wait_already_past_the_deadline(make: Any) -> None:
    """Regression (found by the stateful test, 2026-12-02): a block answered RETRY for longer than
    wait_timeout (asked often enough that the wait went on) was promoted, HIT_PENDING, when its
    tier finally answered HIT: the engine was kept waiting past the deadline."""
    wait = 1.0  # wide margins: a stalled machine must not end the wait between two answers
    mgr = make({"auto_complete": False}, wait_timeout=wait)
    (tier,) = scripted(mgr)
    (k,) = keys(1)
    tier.data[k] = bytes(mgr.block_bytes)
    tier.retry_keys.add(k)
    req = RequestContext("r")
    mgr.on_new_request(req)
    started = time.monotonic()
    assert mgr.lookup(k, req) is LookupResult.RETRY
    while time.monotonic() - started < wait * 0.7:  # asked again and again, within the deadline
        time.sleep(wait / 10)
        mgr.on_schedule_end()
        assert mgr.lookup(k, req) is LookupResult.RETRY
    time.sleep(wait * 0.4)  # the last answer is recent, the wait's start is past the deadline
    tier.retry_keys.discard(k)
    mgr.on_schedule_end()
    assert mgr.lookup(k, req) is LookupResult.MISS, "the wait would go on past wait_timeout"
    assert k not in mgr.primary, "no row reserved for a promotion nobody waits for"


def test_a_promotion_rejoining_an_earlier_batch_begins_its_own_wait(make: Any) -> None:
    """Regression (review of the fix above): a promotion that rejoined a batch which was not the
    last one queued (request A, then B, then A again) still took that batch's old clock."""
    mgr = make({"auto_complete": False})
    (tier,) = scripted(mgr)
    a, b, c = keys(3)
    for k in (a, b, c):
        tier.data[k] = bytes(mgr.block_bytes)
    first, second = RequestContext("first"), RequestContext("second")
    mgr.on_new_request(first)
    mgr.on_new_request(second)
    assert mgr.lookup(a, first) is LookupResult.HIT_PENDING  # the batch of (tier, first)
    assert mgr.lookup(c, second) is LookupResult.HIT_PENDING  # the batch of (tier, second)
    time.sleep(WAIT * 1.5)  # the step goes on
    assert mgr.lookup(b, first) is LookupResult.HIT_PENDING  # rejoins (tier, first): its wait begins now
    assert mgr.lookup(b, first) is LookupResult.HIT_PENDING
