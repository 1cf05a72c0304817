"""HeadFanout: a step's existence checks over tier-owned threads (kvtier.tiers.s3_checks).

The HEAD itself is a collaborator here (a function over a set of present keys,
with gates to hold it), the fan-out and its threads are real.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.keys import BlockKey
from kvtier.tiers.s3_checks import FIRST_WINDOW, HeadFanout


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "big"))


class Bucket:
    """What the HEAD sees: present keys, keys whose HEAD fails, and a gate that holds HEADs."""

    def __init__(self, present: set[BlockKey]) -> None:
        self.present = present
        self.failing: set[BlockKey] = set()
        self.asked: list[BlockKey] = []
        # per key, what its next HEADs do: "lost", "slow" (held until `released`), "fail" (at once),
        # "held" (until the test ends)
        self.script: dict[BlockKey, list[str]] = {}
        self.released = threading.Event()
        self.held = threading.Event()
        self.delay = 0.0  # seconds each HEAD not scripted otherwise takes
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()

    def head(self, k: BlockKey) -> bool:
        with self.lock:
            self.asked.append(k)
            steps = self.script.get(k)
            step = steps.pop(0) if steps else "asked"
        if step in ("lost", "slow"):  # no answer until released; then a timeout, or the answer
            assert self.released.wait(30)
            if step == "lost":
                raise TimeoutError(f"HEAD of {k.hex()[:8]} timed out")
        elif step == "fail":
            raise ConnectionError(f"HEAD of {k.hex()[:8]} failed at once")
        elif step == "held":  # held until the test ends
            assert self.held.wait(30)
        else:
            time.sleep(self.delay)
        assert self.gate.wait(30)
        if k in self.failing:
            raise ConnectionError(f"HEAD of {k.hex()[:8]} failed")
        return k in self.present


class Fanout:
    def __init__(self, bucket: Bucket, threads: int) -> None:
        self.bucket = bucket
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.heads = HeadFanout(bucket.head, self.stopping)
        self.heads.start(threads, self._start)

    def _start(self, role: str, target: object) -> None:
        thread = threading.Thread(target=target, name=role, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self.threads.append(thread)

    def close(self) -> None:
        self.bucket.gate.set()
        self.bucket.released.set()
        self.bucket.held.set()
        self.stopping.set()
        self.heads.stop()
        for thread in self.threads:
            thread.join(10)
        assert not any(t.is_alive() for t in self.threads)


@pytest.fixture
def make() -> Iterator[object]:
    made: list[Fanout] = []

    def build(bucket: Bucket, threads: int = 4) -> Fanout:
        made.append(Fanout(bucket, threads))
        return made[-1]

    yield build
    for fanout in made:
        fanout.close()


def test_a_chain_stops_at_its_first_absent_key_and_windows_double(make: object) -> None:
    chain = [key(i) for i in range(100)]
    bucket = Bucket(set(chain[:30]))
    fanout = make(bucket)  # type: ignore[operator]
    answers, errors, hedged = fanout.heads.check([chain], 10.0, hedge_after=5.0)
    assert errors == [] and hedged == 0
    assert answers == {**{k: True for k in chain[:30]}, chain[30]: False}
    # windows of 8, 16, 32: the third window (keys 24..55) was asked whole, nothing after it
    assert set(bucket.asked) == set(chain[: FIRST_WINDOW + 2 * FIRST_WINDOW + 4 * FIRST_WINDOW])
    short = [key(100 + i) for i in range(5)]
    bucket.asked.clear()
    answers, errors, _ = fanout.heads.check([short], 10.0)
    assert answers == {short[0]: False} and errors == [] and set(bucket.asked) == set(short)


def test_chains_are_checked_independently_and_a_failed_head_ends_its_chain(make: object) -> None:
    a = [key(i) for i in range(10)]
    b = [key(50 + i) for i in range(10)]
    bucket = Bucket(set(a) | set(b))
    bucket.failing.add(b[3])
    fanout = make(bucket)  # type: ignore[operator]
    answers, errors, _ = fanout.heads.check([a, b], 10.0)
    assert all(answers[k] for k in a)
    assert [answers.get(k) for k in b[:5]] == [True, True, True, False, None]
    assert len(errors) == 1 and isinstance(errors[0], ConnectionError) and "failed" in str(errors[0])


def test_at_the_deadline_running_heads_count_absent_and_queued_ones_are_cancelled(make: object) -> None:
    chain = [key(i) for i in range(8)]
    bucket = Bucket(set(chain))
    bucket.gate.clear()
    fanout = make(bucket, threads=2)  # type: ignore[operator]
    started = time.monotonic()
    answers, errors, _ = fanout.heads.check([chain], 0.3)
    took = time.monotonic() - started
    assert 0.25 <= took < 5.0
    # two HEADs were running (one per thread): absent; the six queued ones were never asked
    assert len(answers) == 2 and not any(answers.values())
    assert len(errors) == 1 and isinstance(errors[0], TimeoutError) and "2 existence check(s)" in str(errors[0])
    bucket.gate.set()
    deadline = time.monotonic() + 10
    while len(bucket.asked) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert len(bucket.asked) == 2, "a cancelled HEAD ran after its check gave up"
    answers, errors, _ = fanout.heads.check([chain], 10.0)  # the threads serve the next check
    assert answers == {k: True for k in chain} and errors == []


def test_stopping_cancels_queued_heads_and_ends_every_thread(make: object) -> None:
    chain = [key(i) for i in range(8)]
    bucket = Bucket(set(chain))
    bucket.gate.clear()
    fanout = make(bucket, threads=2)  # type: ignore[operator]
    result: list[object] = []
    checker = threading.Thread(target=lambda: result.append(fanout.heads.check([chain], 30.0)))
    checker.start()
    deadline = time.monotonic() + 10
    while len(bucket.asked) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    fanout.stopping.set()
    fanout.heads.stop()
    checker.join(5)  # the two running HEADs are still held: the check must not wait for them
    assert not checker.is_alive(), "a check waited for its HEADs after the tier stopped"
    bucket.gate.set()
    answers, errors, _ = result[0]  # type: ignore[misc]
    assert answers == {} and errors == []
    assert len(bucket.asked) == 2, "a queued HEAD ran after the tier stopped"
    for thread in fanout.threads:
        thread.join(10)
    assert not any(t.is_alive() for t in fanout.threads)
    assert fanout.heads.check([chain], 1.0) == ({}, [], 0), "after stop nothing is asked"


def test_the_package_never_calls_obstore_async_functions() -> None:
    """An async obstore call answers from a runtime thread that takes the GIL; at interpreter exit
    that aborts the process (SIGABRT), so the package uses blocking calls on its own threads."""
    src = Path(__file__).resolve().parents[2] / "src" / "kvtier"
    users = [p.relative_to(src) for p in src.rglob("*.py") if "_async(" in p.read_text() and "obs" in p.read_text()]
    assert users == []


def test_a_check_starved_by_earlier_late_heads_reports_it(make: object) -> None:
    """The HEAD threads are shared: a check whose HEADs never started before its deadline (every
    thread held by an earlier check's late HEADs) leaves its keys unknown and says so in a
    TimeoutError, which the tier hands to its breaker (a slow store is heard of)."""
    first, second = [key(i) for i in range(4)], [key(100 + i) for i in range(4)]
    bucket = Bucket(set(first) | set(second))
    bucket.gate.clear()
    fanout = make(bucket, threads=4)  # type: ignore[operator]
    answers, errors, _ = fanout.heads.check([first], 0.2)
    assert answers == {k: False for k in first} and "4 existence check(s) missed" in str(errors[-1])
    answers, errors, _ = fanout.heads.check([second], 0.2)
    assert answers == {}
    assert len(errors) == 1 and isinstance(errors[0], TimeoutError) and "4 more never started" in str(errors[0])
    bucket.gate.set()
    answers, errors, _ = fanout.heads.check([second], 10.0)
    assert answers == {k: True for k in second} and errors == []


def test_many_chains_at_once_each_get_their_own_answers(make: object) -> None:
    chains = [[key(1000 * c + i) for i in range(40)] for c in range(64)]
    present = {k for c, chain in enumerate(chains) for k in chain[: c % 41]}  # chain c: its first c keys
    bucket = Bucket(present)
    fanout = make(bucket, threads=8)  # type: ignore[operator]
    answers, errors, _ = fanout.heads.check(chains, 30.0)
    assert errors == []
    for c, chain in enumerate(chains):
        held = c % 41
        expect = {k: True for k in chain[:held]}
        if held < len(chain):
            expect[chain[held]] = False
        assert {k: answers[k] for k in chain if k in answers} == expect, f"chain {c}"


def test_a_head_unanswered_past_hedge_after_is_sent_again_and_the_first_answer_wins(make: object) -> None:
    """Regression (CI of c35a97a, S3 fleet test): one HEAD that never answered held its chain's
    first key for the whole deadline, then counted it absent (the engine recomputed a prefix the
    bucket held). A HEAD still running ``hedge_after`` into its window is sent a second time;
    the twin's answer decides the key, and the chain goes on to its next window."""
    chain = [key(i) for i in range(12)]
    bucket = Bucket(set(chain))
    bucket.script[chain[0]] = ["lost"]
    fanout = make(bucket)  # type: ignore[operator]
    started = time.monotonic()
    answers, errors, hedged = fanout.heads.check([chain], 10.0, hedge_after=0.2)
    took = time.monotonic() - started
    assert answers == {k: True for k in chain} and errors == [] and hedged == 1
    assert 0.2 <= took < 5.0, "answered by the hedge, long before the deadline"
    assert bucket.asked.count(chain[0]) == 2 and len(bucket.asked) == 13


def test_without_hedge_after_a_lost_head_waits_out_the_deadline(make: object) -> None:
    chain = [key(i) for i in range(3)]
    bucket = Bucket(set(chain))
    bucket.script[chain[0]] = ["lost"]
    fanout = make(bucket)  # type: ignore[operator]
    answers, errors, hedged = fanout.heads.check([chain], 0.4)
    assert hedged == 0 and answers[chain[0]] is False
    assert len(errors) == 1 and "1 existence check(s) missed" in str(errors[0])


def test_a_key_fails_only_once_both_its_heads_failed(make: object) -> None:
    """Both HEADs of a key lost: at the deadline it counts absent (late) once, hedged once; a HEAD
    that fails fast (before hedge_after) is not hedged: its error ends the chain at once."""
    chain = [key(i) for i in range(3)]
    bucket = Bucket(set(chain))
    bucket.script[chain[1]] = ["lost", "lost"]
    fanout = make(bucket)  # type: ignore[operator]
    answers, errors, hedged = fanout.heads.check([chain], 0.6, hedge_after=0.2)
    assert hedged == 1 and bucket.asked.count(chain[1]) == 2
    assert answers == {chain[0]: True, chain[1]: False, chain[2]: True}
    assert len(errors) == 1 and "1 existence check(s) missed" in str(errors[0])
    bucket.released.set()  # the two lost HEADs fail now (their thread ends), nobody listens
    other = [key(100 + i) for i in range(3)]
    bucket.present.update(other)
    bucket.failing.add(other[0])
    answers, errors, hedged = fanout.heads.check([other], 10.0, hedge_after=0.5)
    assert hedged == 0 and answers == {other[0]: False} and isinstance(errors[0], ConnectionError)


def test_a_hedged_heads_late_twin_is_ignored_once_its_window_was_read(make: object) -> None:
    """Key 5's first HEAD answers only after its hedge did, its window was read and the chain's
    next, shorter window (keys 8-9) went out: the late answer belongs to no window out and is
    dropped (it once indexed the new window by its old position)."""
    chain = [key(i) for i in range(10)]
    bucket = Bucket(set(chain))
    bucket.script.update({chain[5]: ["slow"], chain[8]: ["slow"], chain[9]: ["slow"]})
    fanout = make(bucket)  # type: ignore[operator]
    result: list[object] = []
    checker = threading.Thread(target=lambda: result.append(fanout.heads.check([chain], 10.0, hedge_after=0.2)))
    checker.start()
    deadline = time.monotonic() + 10
    while chain[8] not in bucket.asked and time.monotonic() < deadline:  # the second window is out
        time.sleep(0.005)
    bucket.released.set()  # key 5's first HEAD answers now, late; keys 8 and 9 answer too
    checker.join(10)
    assert not checker.is_alive()
    answers, errors, hedged = result[0]  # type: ignore[misc]
    assert answers == {k: True for k in chain} and errors == [] and hedged >= 1


def test_at_the_deadline_a_failed_head_whose_hedge_never_started_is_that_failure() -> None:
    """A hedge goes to an idle thread, which may still take other work first: at the deadline
    a key whose first HEAD failed and whose hedge is still queued is that failure, the hedge
    cancelled (before: counted "never started", the key left unknown). The window and its
    HEADs are built by hand: which thread takes what first cannot be arranged from outside."""
    from concurrent.futures import Future

    from kvtier.tiers.s3_checks import _give_up, _Window

    k0, k1 = key(0), key(1)
    window = _Window(0, 0, 0, FIRST_WINDOW, [k0, k1])
    failed: Future[bool] = Future()
    assert failed.set_running_or_notify_cancel()
    failed.set_exception(TimeoutError("HEAD of k0 timed out"))
    hedge: Future[bool] = Future()  # queued, never started
    running: Future[bool] = Future()
    assert running.set_running_or_notify_cancel()
    window.heads = [[failed, hedge], [running]]
    answers: dict[BlockKey, bool] = {}
    errors = _give_up({0: window}, answers, 1.0)
    assert hedge.cancelled() and not running.cancelled()
    assert answers == {k0: False, k1: False}
    assert errors[0] is failed.exception() and "1 existence check(s) missed" in str(errors[1])
    assert "0 more never started" in str(errors[1])


_FIRST = st.sampled_from(["asked", "asked", "asked", "fail", "lost", "slow"])
_HEDGE = st.sampled_from(["asked", "fail", "lost"])


@settings(max_examples=10, deadline=None)
@given(
    st.lists(st.lists(st.tuples(st.booleans(), _FIRST, _HEDGE), min_size=1, max_size=30), min_size=1, max_size=3)
)
def test_checks_with_hedges_answer_as_a_model_of_chains_says(chains_spec: list[list[tuple[bool, str, str]]]) -> None:
    """Property: for chains of keys (each present or not, its first HEAD answering, failing, lost
    or slow, and its hedge answering, failing or lost), the check's answers, errors and hedges are
    what a model says: windows of 8, 16, 32 read in chain order up to the first absent or failed
    key; a lost or slow first HEAD is hedged and its hedge decides the key, unless the hedge
    failed or is lost too (then the key is late: absent at the deadline, with the other keys of
    its window decided so far). HEAD threads are plenty, so no HEAD waits for one."""
    timeout, hedge_after = 1.5, 0.3  # (three windows hedged in turn fit the deadline with room)
    chains = [[key(1000 * c + i) for i in range(len(spec))] for c, spec in enumerate(chains_spec)]
    bucket = Bucket({k for chain, spec in zip(chains, chains_spec, strict=True)
                     for k, (present, _, _) in zip(chain, spec, strict=True) if present})  # fmt: skip
    for chain, spec in zip(chains, chains_spec, strict=True):
        for k, (_, first, hedge) in zip(chain, spec, strict=True):
            bucket.script[k] = [first, hedge]
    expected: dict[BlockKey, bool] = {}
    failures = late = min_hedged = 0
    for chain, spec in zip(chains, chains_spec, strict=True):
        start, width = 0, FIRST_WINDOW
        while start < len(chain):
            window = list(zip(chain[start : start + width], spec[start : start + width], strict=True))
            outcomes: list[bool | str] = []  # True/False answered, "fail", "late"
            for _, (present, first, hedge) in window:
                step = first if first in ("asked", "fail") else hedge
                min_hedged += first in ("lost", "slow")
                outcomes.append(present if step == "asked" else "fail" if first == "fail" else "late")
            if "late" in outcomes:  # the deadline finds this window out: what was decided is kept
                for (k, _), outcome in zip(window, outcomes, strict=True):
                    expected[k] = outcome is True
                    failures += outcome == "fail"
                    late += outcome == "late"
                break
            for (k, _), outcome in zip(window, outcomes, strict=True):
                expected[k] = outcome is True
                if outcome is not True:
                    failures += outcome == "fail"
                    break
            else:
                start, width = start + width, width * 2
                continue
            break
    fanout = Fanout(bucket, threads=2 * sum(len(c) for c in chains))
    try:
        answers, errors, hedged = fanout.heads.check(chains, timeout, hedge_after=hedge_after)
    finally:
        fanout.close()
    assert answers == expected
    assert hedged >= min_hedged  # (a fast HEAD slowed past hedge_after by a loaded host is hedged too)
    assert sum(isinstance(e, ConnectionError) for e in errors) == failures
    timeouts = [e for e in errors if isinstance(e, TimeoutError)]
    assert len(timeouts) == (1 if late else 0)
    if late:
        assert f"{late} existence check(s) missed" in str(timeouts[0])


def test_a_store_slow_throughout_gets_no_hedges_and_answers_as_before(make: object) -> None:
    """Review (helper-68): with every HEAD taking half the deadline, hedges queued behind busy
    threads ran after their keys were answered and pushed the next check past its deadline. A
    hedge goes out only to an idle thread, and a decided key's HEADs not started are cancelled."""
    keys = [key(i) for i in range(8)]
    bucket = Bucket(set(keys))
    bucket.delay = 0.5
    fanout = make(bucket, threads=4)  # type: ignore[operator]
    for chain in (keys[:4], keys[4:]):
        answers, errors, hedged = fanout.heads.check([chain], 1.0, hedge_after=0.4)
        assert errors == [] and hedged == 0 and answers == {k: True for k in chain}
    assert len(bucket.asked) == 8


@pytest.mark.parametrize(
    ("script", "answer", "failure"),
    [
        (["slow", "fail"], True, None),  # the hedge fails at once, the first HEAD answers later
        (["lost", "slow"], True, None),  # the first fails after its hedge went out, the hedge answers
        (["lost", "fail"], False, TimeoutError),  # both fail: the key is the first HEAD's failure
    ],
)
def test_a_key_is_its_first_answer_and_fails_only_once_all_its_heads_failed(
    make: object, script: list[str], answer: bool, failure: type[BaseException] | None
) -> None:
    """Key 0's first HEAD is held, its hedge goes out; whatever the hedge did, the key waits
    while its first HEAD is out, then is decided by the first answer of the two, or by the first
    HEAD's failure when both failed (reported before the deadline)."""
    chain = [key(i) for i in range(2)]
    bucket = Bucket(set(chain))
    bucket.script[chain[0]] = list(script)
    fanout = make(bucket)  # type: ignore[operator]
    result: list[object] = []
    checker = threading.Thread(target=lambda: result.append(fanout.heads.check([chain], 10.0, hedge_after=0.2)))
    checker.start()
    deadline = time.monotonic() + 10
    while bucket.asked.count(chain[0]) < 2 and time.monotonic() < deadline:  # the hedge went out
        time.sleep(0.005)
    time.sleep(0.1)
    assert checker.is_alive(), "the key was decided while its first HEAD was still out"
    bucket.released.set()
    checker.join(5)
    answers, errors, hedged = result[0]  # type: ignore[misc]
    assert hedged == 1 and answers[chain[0]] is answer
    if failure is None:
        assert errors == [] and answers == {k: True for k in chain}
    else:
        assert answers == {chain[0]: False} and len(errors) == 1 and isinstance(errors[0], failure)
        assert "HEAD of" in str(errors[0])
