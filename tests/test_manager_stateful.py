"""A hypothesis state machine driving TieringManager through random interleavings.

The manager under test is real: a real /dev/shm region, the real PrimaryTier with
LRU, ARC or the return-time policy. Its collaborators, the secondary tiers, are in-memory doubles
(:class:`MemoryTierDouble`) that finish jobs only when the machine says so,
really copy bytes between their store and the shared rows, and can fail jobs,
reject submissions, answer MISS (unhealthy) or RETRY, forget blocks, and refuse
to drain.

The machine keeps a model of every block it has a stake in: device stores in
flight, promotions in flight, device loads holding pins, and the cascades the
doubles hold (each pins its rows until the manager has polled its result). After
every step it checks:

* ref counts: -1 exactly for blocks in flight, otherwise exactly the number of
  pins the model expects; never below -1; a pinned or in-flight block is never
  evicted;
* slots: the index is injective and every live reservation (device store,
  promotion, device load, cascade) sits on its key's slot, so no row is reused
  while a job on it is in flight;
* bytes: every ready block's row holds exactly that block's bytes, every double
  holds exactly the stored bytes, and every device load reads them back;
* lookups answer what the model predicts (HIT / HIT_PENDING / RETRY / MISS);
* polling happens at most once per step; a tier's per-request finished hook runs
  once, after the request's last store, and no cascade of that request follows;
* ``settle`` (tiers complete everything, a few step ends): every promotion ended
  as HIT or MISS; ``reset_cache``: nothing is left in flight;
* every wait has an end: time passes (a fake clock drives the manager's), loads fail
  or never finish, tiers answer RETRY forever, and no lookup answers RETRY or
  HIT_PENDING for a block waited on longer than ``wait_timeout``; a tier whose load of a
  block failed is not believed about it for ``failed_load_seconds``; a tier with a job
  in flight past the deadline gets no lookup and no cascade until it reports it.

Bugs it found have minimal guards in ``tests/test_manager_regressions.py``.
"""

from __future__ import annotations

import gc
import hashlib
import json
from collections import Counter
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, ClassVar
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier import BackpressureSettings, KVGeometry, LookupResult, Namespace, RequestContext, TieringManager, chain_ids
from kvtier.errors import TierDrainTimeout, TierError
from kvtier.keys import BlockKey
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TierUsage, TransferJob
from kvtier.tiers.registry import register_tier
from kvtier.types import OffloadPolicy

HIT, HIT_PENDING, RETRY, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY, LookupResult.MISS
BLOCK_BYTES = 4096
NUM_CPU_BLOCKS = 5
NAMESPACE = Namespace("stateful-test", KVGeometry.from_block_bytes(BLOCK_BYTES))
KEYS: list[BlockKey] = chain_ids(range(12), NAMESPACE)
PATTERN: dict[BlockKey, np.ndarray] = {
    k: np.frombuffer(hashlib.shake_128(k).digest(BLOCK_BYTES), dtype=np.uint8) for k in KEYS
}
JUNK = np.full(BLOCK_BYTES, 0xEE, dtype=np.uint8)
# Prefix chains the engine-like scan walks (indices into KEYS); two share a prefix.
CHAINS = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 6, 7, 8], [9, 10, 11]]
SEEDED = [6, 7, 9, 10]  # blocks the second tier holds from "a previous run"
WAIT = 1.0  # the manager's wait_timeout, in seconds of the machine's clock
HOLD = 2.0  # its failed_load_seconds
GAP = max(WAIT, HOLD)  # no lookup of a waited-on block for this long: its wait is over (a new one starts)
CLOCKED = ("core", "tierset", "waits", "ledger", "requests")  # the manager's rooms that read perf_counter


def name(k: BlockKey) -> str:
    return f"k{KEYS.index(k)}"


class MemoryTierDouble(SecondaryTier):
    """An in-memory secondary tier whose jobs finish only when :meth:`run_jobs` says so.

    Contract violations seen from the tier's side are recorded in ``violations``
    (an assertion raised inside a manager call would be swallowed by the
    manager's submit error handling).
    """

    tier_type: ClassVar[str] = "stateful-double"
    medium: ClassVar[str] = "memory"

    def __init__(self, context: TierContext, *, seed: dict[BlockKey, bytes] | None = None) -> None:
        super().__init__(context)
        self.data: dict[BlockKey, bytes] = dict(seed or {})
        self.queued: list[TransferJob] = []
        self.finished: list[tuple[TransferJob, JobResult]] = []
        self.delivered: list[tuple[TransferJob, JobResult]] = []
        self.submitted: list[TransferJob] = []
        self.failing = False
        self.stuck = False
        self.retry_keys: set[BlockKey] = set()
        self.finished_requests: Counter[str] = Counter()
        self.touched: list[BlockKey] = []
        self.polls = 0
        self.drains = 0
        self.violations: list[str] = []

    def answer(self, key: BlockKey) -> LookupResult:
        if self.failing:
            return MISS  # unhealthy: MISS at once
        if key in self.retry_keys:
            return RETRY
        return HIT if key in self.data else MISS

    def lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        return self.answer(key)

    def _submit(self, job: TransferJob) -> None:
        if self.failing:
            raise TierError(f"{self.label}: not accepting jobs (test double told to fail)")
        if job.request is not None and self.finished_requests[job.request.req_id]:
            self.violations.append(f"job {job.job_id} for {job.request.req_id} after its finished hook")
        if len(job.keys) != len(job.slots) or not job.keys:
            self.violations.append(f"job {job.job_id}: {len(job.keys)} keys, {len(job.slots)} slots")
        self.queued.append(job)
        self.submitted.append(job)

    def submit_store(self, job: TransferJob) -> None:
        if job.is_promotion:
            self.violations.append(f"submit_store got promotion job {job.job_id}")
        self._submit(job)

    def submit_load(self, job: TransferJob) -> None:
        if not job.is_promotion:
            self.violations.append(f"submit_load got store job {job.job_id}")
        self._submit(job)

    def run_jobs(self, count: int, outcome: str = "ok") -> None:
        """Finish the ``count`` oldest jobs: ``ok``, ``fail``, or ``partial`` (every other key)."""
        rows, n = self.context.rows, self.context.block_bytes
        batch, self.queued = self.queued[:count], self.queued[count:]
        for job in batch:
            ok: list[BlockKey] = []
            for i, (key, slot) in enumerate(zip(job.keys, job.slots, strict=True)):
                good = not self.failing and (outcome == "ok" or (outcome == "partial" and i % 2 == 0))
                if job.is_promotion:
                    if good and key in self.data:
                        rows[slot, :n] = np.frombuffer(self.data[key], dtype=np.uint8)
                        ok.append(key)
                    else:
                        rows[slot, :n] = JUNK  # a torn write: must never be served
                elif good:
                    self.data[key] = rows[slot, :n].tobytes()
                    ok.append(key)
            if len(ok) == len(job.keys):
                result = JobResult(job.job_id, True, bytes_moved=len(ok) * n)
            else:
                result = JobResult(job.job_id, False, frozenset(ok), len(ok) * n, error="double: failed")
            self.finished.append((job, result))

    def poll_finished(self) -> list[JobResult]:
        self.polls += 1
        self.delivered.extend(self.finished)
        done, self.finished = [r for _, r in self.finished], []
        return done

    def touch(self, keys: Any, request: RequestContext | None) -> None:
        self.touched.extend(keys)

    def on_new_request(self, request: RequestContext) -> OffloadPolicy:
        wants = request.params.get("request_level_tier") == self.context.index
        return OffloadPolicy.REQUEST_LEVEL if wants else OffloadPolicy.BLOCK_LEVEL

    def on_request_finished(self, request: RequestContext) -> None:
        self.finished_requests[request.req_id] += 1

    def has_pending_work(self) -> bool:
        return bool(self.queued)

    def usage(self) -> TierUsage:
        return TierUsage(len(self.data) * self.context.block_bytes, None, len(self.data))

    def drain(self, timeout: float | None = None) -> None:
        self.drains += 1
        if self.stuck:
            raise TierDrainTimeout(f"{self.label}: {len(self.queued)} job(s) did not finish within {timeout}s")
        self.run_jobs(len(self.queued))

    def shutdown(self) -> None:
        self.queued.clear()


register_tier("stateful-double", f"{__name__}:MemoryTierDouble")
pytestmark = pytest.mark.slow  # ~8 s per policy on the 2-core machine


@dataclass
class Req:
    ctx: RequestContext
    chain: list[int]
    request_level_tier: int | None
    finished: bool = False
    pending: set[BlockKey] = field(default_factory=set)  # the manager's pending device stores


@dataclass
class StoreBatch:
    req: Req | None  # None: a store without a request
    keys: list[BlockKey]


@dataclass
class Promotion:
    tier: int  # 0-based position
    req_id: str | None
    slot: int
    submitted: bool = False
    wait_began: float = 0.0  # the wait on the block: from this promotion, or its RETRYs before


class ManagerMachine(RuleBasedStateMachine):
    policy: ClassVar[str] = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.clock = 1000.0  # seconds; only the time_passes rule moves it
        self.patches = [mock.patch(f"kvtier.manager.{room}.perf_counter", lambda: self.clock) for room in CLOCKED]
        for patch in self.patches:
            patch.start()
        seed = {KEYS[i]: PATTERN[KEYS[i]].tobytes() for i in SEEDED}
        self.mgr = TieringManager.create(
            namespace=NAMESPACE,
            num_cpu_blocks=NUM_CPU_BLOCKS,
            policy=self.policy,
            tiers=[{"type": "stateful-double"}, {"type": "stateful-double", "seed": seed}],
            sweep_stale=False,
            drain_timeout=1.0,
            wait_timeout=WAIT,
            failed_load_seconds=HOLD,
            # Jobs take the machine's seconds: backpressure (not modelled here) would skip cascades.
            backpressure=BackpressureSettings(enabled=False),
        )
        self.doubles = [t for t in self.mgr.tiers if isinstance(t, MemoryTierDouble)]
        assert len(self.doubles) == 2
        self.reqs: list[Req] = []
        self.present: set[BlockKey] = set()
        self.stores: dict[BlockKey, StoreBatch] = {}  # device stores in flight
        self.batches: list[StoreBatch] = []
        self.promotions: dict[BlockKey, Promotion] = {}
        self.loads: list[tuple[Req, list[BlockKey], list[int]]] = []
        self.polled = False
        self.poll_due = False
        self.step_hits: set[BlockKey] = set()  # answered HIT this step: not evictable until it ends
        self.next_req = 0
        # The model of the waits (kvtier.manager.waits): each block's wait [started, last answered],
        # writes in flight given up, the blocks each tier (0-based) may not promise and until when,
        # each tier's open RETRYs, when each job was submitted, and the jobs overdue.
        self.waits: dict[BlockKey, list[float]] = {}
        self.abandoned: set[BlockKey] = set()
        self.withheld: dict[tuple[int, BlockKey], float] = {}
        self.retrying: set[tuple[int, BlockKey]] = set()
        self.job_time: dict[int, float] = {}
        self.overdue: set[int] = set()
        self.runs: dict[BlockKey, list[float]] = {}  # the waits as answers show them (the invariant)

    def teardown(self) -> None:
        region = self.mgr.region
        try:
            self.mgr.shutdown()
        except Exception:
            gc.collect()  # a failing example's traceback may still hold a view of the rows
            self.mgr.shutdown()
        finally:
            for patch in self.patches:
                patch.stop()
        assert region.closed
        assert not region.path.exists()

    # --- the model of the waits -----------------------------------------------------------

    def within(self, k: BlockKey) -> bool:
        """One more RETRY/HIT_PENDING for ``k``: True while its wait is within the deadline."""
        now = self.clock
        wait = self.waits.get(k)
        if wait is None or now - wait[1] > GAP:
            self.waits[k] = [now, now]
            return True
        wait[1] = now
        if now - wait[0] <= WAIT:
            return True
        del self.waits[k]
        return False

    def wait_began(self, k: BlockKey) -> float:
        """When the wait on ``k`` began, for a promotion starting now: it goes on from the RETRYs
        (or failed promotions) before it, unless their last answer is older than GAP."""
        wait = self.waits.get(k)
        return wait[0] if wait is not None and self.clock - wait[1] <= GAP else self.clock

    def serving(self, pos: int) -> bool:
        """No job of tier ``pos`` is overdue and unreported (jobs about to be polled are reported)."""
        double = self.doubles[pos]
        unseen = [] if self.poll_due else [j for j, _ in double.finished]
        return not any(job.job_id in self.overdue for job in [*double.queued, *unseen])

    def withholds(self, pos: int, k: BlockKey) -> bool:
        until = self.withheld.get((pos, k))
        if until is not None and self.clock >= until:
            del self.withheld[(pos, k)]
            return False
        return until is not None

    def answered(self, k: BlockKey, answer: LookupResult) -> None:
        """What the answer shows of the wait on ``k`` (it ends with a HIT or a MISS, or when the
        block becomes readable); none lasts longer than the deadline."""
        if answer is HIT or answer is MISS:
            self.runs.pop(k, None)
            if answer is MISS:  # a MISS ends the block's wait: a later one starts afresh
                self.waits.pop(k, None)
            return
        run = self.runs.get(k)
        if run is None or self.clock - run[1] > GAP:
            run = self.runs[k] = [self.clock, self.clock]
        run[1] = self.clock
        assert self.clock - run[0] <= WAIT, f"{name(k)} answered {answer} {self.clock - run[0]}s into its wait"

    # --- helpers -----------------------------------------------------------------------

    def rows(self) -> np.ndarray:
        rows = self.mgr.primary.rows
        assert rows is not None
        return rows

    def cascade_pins(self) -> Counter[BlockKey]:
        """Pins held by cascades the manager has not yet seen finish (it is about to, if a poll is due)."""
        pins: Counter[BlockKey] = Counter()
        for double in self.doubles:
            unseen = [] if self.poll_due else [j for j, _ in double.finished]
            for job in [*double.queued, *unseen]:
                if not job.is_promotion:
                    pins.update(job.keys)
        return pins

    def expected_ref(self, k: BlockKey) -> int:
        if k in self.stores or k in self.promotions:
            return -1
        load_pins = sum(keys.count(k) for _, keys, _ in self.loads)
        return load_pins + self.cascade_pins()[k]

    def evictable(self, protected: AbstractSet[BlockKey] = frozenset()) -> int:
        """Blocks an eviction may take now: ready, unpinned, not protected, not a HIT of this step."""
        return sum(
            1 for k in self.present if k not in protected and k not in self.step_hits and self.expected_ref(k) == 0
        )

    def before_poll(self) -> list[tuple[MemoryTierDouble, JobResult]]:
        """The manager polls at the first lookup/prepare_* of a step: apply what it will see."""
        if self.polled:
            return []
        self.polled = True
        self.poll_due = True
        expected: list[tuple[MemoryTierDouble, JobResult]] = []
        for double in self.doubles:
            for job, result in double.finished:
                expected.append((double, result))
                if job.is_promotion:
                    ok = set(result.succeeded(job.keys))
                    for k in job.keys:
                        promo = self.promotions.pop(k)
                        assert promo.slot == int(job.slots[list(job.keys).index(k)])
                        self.abandoned.discard(k)
                        if k not in ok:
                            self.present.discard(k)
                            self.withheld[(promo.tier, k)] = self.clock + HOLD
                            self.waits[k] = [promo.wait_began, self.clock]  # the wait goes on
                        else:
                            self.waits.pop(k, None)
                            self.runs.pop(k, None)  # readable: the wait is over
        for double in self.doubles:  # after the poll: the jobs still in flight past the deadline
            for job in double.queued:
                if self.clock - self.job_time[job.job_id] > WAIT:
                    self.overdue.add(job.job_id)
        return expected

    def after_call(self, expected_polls: list[tuple[MemoryTierDouble, JobResult]]) -> None:
        """Check the poll delivered exactly what was finished, and nothing else."""
        self.poll_due = False
        for double in self.doubles:
            got = [r.job_id for _, r in double.delivered]
            want = [r.job_id for d, r in expected_polls if d is double]
            assert got == want, f"tier {double.label}: delivered {got}, expected {want}"
            double.delivered.clear()

    def reconcile_evictions(self, allowed: int) -> list[BlockKey]:
        """Blocks that vanished from the CPU tier; only evictable ones may, at most ``allowed``."""
        gone = [k for k in self.present if self.mgr.primary.ref_count(k) is None]
        assert len(gone) <= allowed, f"{len(gone)} blocks vanished, at most {allowed} evictions allowed"
        for k in gone:
            assert self.expected_ref(k) == 0, f"{name(k)} was evicted with expected ref {self.expected_ref(k)}"
            assert k not in self.step_hits, f"{name(k)} was answered HIT this step, then evicted"
            self.present.discard(k)
        return gone

    def take_submitted(self) -> list[list[TransferJob]]:
        out = [list(d.submitted) for d in self.doubles]
        for d in self.doubles:
            for job in d.submitted:
                self.job_time[job.job_id] = self.clock
            d.submitted.clear()
        return out

    def expected_lookup(self, k: BlockKey, ghosts: int = 0) -> tuple[LookupResult, int | None]:
        """The answer to a lookup of ``k``, and the tier a promotion would start from. ``ghosts``:
        blocks of ``present`` already evicted (evictable ones other than ``k``). Called once per
        lookup: it moves the model of the waits as the manager moves its own."""
        if k in self.present:
            if self.expected_ref(k) != -1:
                return HIT, None
            promotion = self.promotions.get(k)  # else a device store: a wait like a RETRY's
            within = self.clock - promotion.wait_began <= WAIT if promotion is not None else self.within(k)
            if k in self.abandoned or not within:
                self.abandoned.add(k)
                return MISS, None
            return HIT_PENDING, None
        retry = False
        for pos, double in enumerate(self.doubles):
            if not self.serving(pos):
                continue
            answer = double.answer(k)
            if answer is MISS:
                self.retrying.discard((pos, k))
                continue
            if self.withholds(pos, k):
                continue
            if answer is RETRY:
                self.retrying.add((pos, k))
                retry = True
                continue
            self.retrying.discard((pos, k))
            wait = self.waits.get(k)  # a promotion goes on with the wait its RETRYs began...
            if wait is not None and self.clock - wait[1] <= GAP and self.clock - wait[0] > WAIT:
                del self.waits[k]  # ...unless that is past the deadline: the wait ends with a MISS
                return MISS, None
            room = len(self.present) - ghosts < NUM_CPU_BLOCKS or self.evictable({k}) - ghosts > 0
            return (HIT_PENDING, pos) if room else (MISS, None)
        if not retry:
            return MISS, None
        if self.within(k):
            return RETRY, None
        for pos in range(len(self.doubles)):
            if (pos, k) in self.retrying:
                self.retrying.discard((pos, k))
                self.withheld[(pos, k)] = self.clock + HOLD
        return MISS, None

    def active(self) -> list[Req]:
        return [r for r in self.reqs if not r.finished]

    # --- requests ------------------------------------------------------------------------

    @initialize(chain=st.integers(0, len(CHAINS) - 1), request_level_tier=st.sampled_from([None, None, 1, 2]))
    def first_request(self, chain: int, request_level_tier: int | None) -> None:
        self.new_request(chain, request_level_tier)

    @precondition(lambda self: len(self.active()) < 3)
    @rule(chain=st.integers(0, len(CHAINS) - 1), request_level_tier=st.sampled_from([None, None, 1, 2]))
    def new_request(self, chain: int, request_level_tier: int | None) -> None:
        self.next_req += 1
        params = {} if request_level_tier is None else {"request_level_tier": request_level_tier}
        req = Req(RequestContext(f"r{self.next_req}", params), CHAINS[chain], request_level_tier)
        policy = self.mgr.on_new_request(req.ctx)
        assert policy is (OffloadPolicy.BLOCK_LEVEL if request_level_tier is None else OffloadPolicy.REQUEST_LEVEL)
        self.reqs.append(req)

    @precondition(lambda self: self.active())
    @rule(pick=st.integers(0, 100))
    def finish_request(self, pick: int) -> None:
        req = self.active()[pick % len(self.active())]
        req.finished = True
        self.mgr.on_request_finished(req.ctx)

    # --- lookups and loads ---------------------------------------------------------------

    def do_lookup(self, req: Req, k: BlockKey) -> LookupResult:
        polls = self.before_poll()
        expected, tier = self.expected_lookup(k)
        result = self.mgr.lookup(k, req.ctx)
        self.after_call(polls)
        assert result is expected, f"lookup({name(k)}) = {result}, model expected {expected}"
        self.answered(k, result)
        if result is HIT:
            self.step_hits.add(k)
        if tier is not None:
            slot = self.mgr.primary.slot_of(k)
            assert slot is not None and self.mgr.primary.ref_count(k) == -1
            self.promotions[k] = Promotion(tier, req.ctx.req_id, slot, wait_began=self.wait_began(k))
            self.reconcile_evictions(allowed=1)
            self.present.add(k)
        else:
            self.reconcile_evictions(allowed=0)
        return result

    @precondition(lambda self: self.active())
    @rule(pick=st.integers(0, 100), i=st.integers(0, len(KEYS) - 1))
    def lookup(self, pick: int, i: int) -> None:
        self.do_lookup(self.active()[pick % len(self.active())], KEYS[i])

    @precondition(lambda self: self.active())
    @rule(pick=st.integers(0, 100))
    def scan_and_load(self, pick: int) -> None:
        """What an engine does per request: look up the prefix until MISS, then load the HIT prefix."""
        req = self.active()[pick % len(self.active())]
        hit_prefix: list[BlockKey] = []
        counting = True
        for i in req.chain:
            result = self.do_lookup(req, KEYS[i])
            if result is MISS:
                break
            if result is HIT and counting:
                hit_prefix.append(KEYS[i])
            else:
                counting = False
        if hit_prefix:
            self.do_prepare_load(req, hit_prefix)

    @precondition(lambda self: self.active())
    @rule(pick=st.integers(0, 100), load=st.booleans())
    def scan_prefix_and_load(self, pick: int, load: bool) -> None:
        """The same scan in one call (lookup_prefix): every answer must be the one lookup per key
        would have given. Promotions inside the call may evict blocks; which one went when is
        the policy's choice, so the model replays the scan knowing only which blocks are gone
        (a HIT is protected and an in-flight block never evictable, so a gone key of the scan
        was evicted before its turn, and may have been promoted again at its turn)."""
        req = self.active()[pick % len(self.active())]
        chain = [KEYS[i] for i in req.chain]
        polls = self.before_poll()
        was_ready = {k for k in self.present if self.expected_ref(k) >= 0}
        result = self.mgr.lookup_prefix(chain, req.ctx)
        self.after_call(polls)
        # Gone: evicted (a ready block of the scan may also have been promoted again after that).
        refs = {k: self.mgr.primary.ref_count(k) for k in self.present}
        gone = {k for k, ref in refs.items() if ref is None or (k in was_ready and ref == -1)}
        ghosts = 0  # blocks evicted so far in the replay, still in self.present
        for i, (k, got) in enumerate(zip(chain, result.answers, strict=False)):
            if k in gone:
                assert ghosts > 0, f"{name(k)} vanished before any eviction could take it"
                self.present.discard(k)
                gone.discard(k)
                ghosts -= 1
            expected, tier = self.expected_lookup(k, ghosts)
            assert got is expected, f"lookup_prefix answer {i} ({name(k)}) = {got}, model expected {expected}"
            self.answered(k, got)
            if got is HIT:
                self.step_hits.add(k)
            if tier is not None:
                if len(self.present) - ghosts >= NUM_CPU_BLOCKS:
                    ghosts += 1
                slot = self.mgr.primary.slot_of(k)
                assert slot is not None and self.mgr.primary.ref_count(k) == -1
                self.promotions[k] = Promotion(tier, req.ctx.req_id, slot, wait_began=self.wait_began(k))
                self.present.add(k)
        misses = [i for i, a in enumerate(result.answers) if a is MISS]
        assert len(result.answers) == (misses[0] + 1 if misses else len(chain)), "the scan stops at the first MISS"
        assert ghosts == len(gone), f"{len(gone)} blocks vanished, {ghosts} evictions replayed"
        for k in gone:
            assert self.expected_ref(k) == 0 and k not in self.step_hits
            self.present.discard(k)
        ready = next((i for i, a in enumerate(result.answers) if a is not HIT), len(result.answers))
        assert result.ready == ready
        assert result.found == sum(a in (HIT, HIT_PENDING) for a in result.answers)
        assert result.deferred == any(a in (HIT_PENDING, RETRY) for a in result.answers)
        if load and ready:
            self.do_prepare_load(req, chain[:ready])

    def do_prepare_load(self, req: Req, keys: list[BlockKey]) -> None:
        polls = self.before_poll()
        slots = self.mgr.prepare_load(keys, req.ctx)
        self.after_call(polls)
        rows = self.rows()
        for k, slot in zip(keys, slots, strict=True):
            assert slot == self.mgr.primary.slot_of(k)
            assert np.array_equal(rows[slot, :BLOCK_BYTES], PATTERN[k]), f"load of {name(k)} read wrong bytes"
        self.loads.append((req, list(keys), [int(s) for s in slots]))

    @precondition(lambda self: self.active() and any(self.expected_ref(k) >= 0 for k in self.present))
    @rule(pick=st.integers(0, 100), picks=st.lists(st.integers(0, 100), min_size=1, max_size=3))
    def prepare_load(self, pick: int, picks: list[int]) -> None:
        req = self.active()[pick % len(self.active())]
        ready = sorted((k for k in self.present if self.expected_ref(k) >= 0), key=KEYS.index)
        self.do_prepare_load(req, [ready[p % len(ready)] for p in picks])

    @precondition(lambda self: self.loads)
    @rule(pick=st.integers(0, 100))
    def complete_load(self, pick: int) -> None:
        req, keys, _ = self.loads.pop(pick % len(self.loads))
        self.mgr.complete_load(keys, req.ctx)

    @precondition(lambda self: self.active())
    @rule(pick=st.integers(0, 100), idx=st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=3))
    def touch(self, pick: int, idx: list[int]) -> None:
        req = self.active()[pick % len(self.active())]
        keys = [KEYS[i] for i in idx]
        marks = [len(d.touched) for d in self.doubles]
        self.mgr.touch(keys, req.ctx)
        for double, mark in zip(self.doubles, marks, strict=True):
            assert double.touched[mark:] == keys

    # --- stores ----------------------------------------------------------------------------

    @precondition(lambda self: self.active())
    @rule(
        pick=st.integers(0, 100),
        idx=st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=4),
        anonymous=st.booleans(),
    )
    def prepare_store(self, pick: int, idx: list[int], anonymous: bool) -> None:
        req = None if anonymous else self.active()[pick % len(self.active())]
        keys = [KEYS[i] for i in idx]
        polls = self.before_poll()
        new = [k for k in dict.fromkeys(keys) if k not in self.present]
        shortfall = len(new) - (NUM_CPU_BLOCKS - len(self.present))
        feasible = shortfall <= self.evictable(set(keys))
        before = self.cascade_pins()
        result = self.mgr.prepare_store(keys, None if req is None else req.ctx)
        self.after_call(polls)
        if result is None:
            assert not feasible, "prepare_store refused although enough blocks were evictable"
            self.reconcile_evictions(allowed=0)
            return
        assert feasible, "prepare_store succeeded although too few blocks were evictable"
        assert list(result.keys_to_store) == new
        gone = self.reconcile_evictions(allowed=max(0, shortfall))
        assert sorted(gone) == sorted(result.evicted_keys)
        assert len(gone) == max(0, shortfall)
        assert not set(gone) & set(keys), "prepare_store evicted one of the keys being stored"
        assert len(set(int(s) for s in result.slots)) == len(new)
        batch = StoreBatch(req, list(new))
        for k, slot in zip(new, result.slots, strict=True):
            assert self.mgr.primary.slot_of(k) == slot and self.mgr.primary.ref_count(k) == -1
            self.present.add(k)
            self.stores[k] = batch
        if new:
            self.batches.append(batch)
        if req is not None:
            req.pending.update(new)
        submitted = self.take_submitted()
        for pos, jobs in enumerate(submitted):
            if jobs:  # only request-level cascades of blocks already present
                assert req is not None and req.request_level_tier == pos + 1
                for job in jobs:
                    assert set(job.keys) <= set(keys) - set(new)
        assert self.cascade_pins() - before == Counter(k for jobs in submitted for j in jobs for k in j.keys)

    @precondition(lambda self: self.batches)
    @rule(pick=st.integers(0, 100), success=st.booleans(), part=st.sampled_from(["all", "first", "last"]))
    def complete_store(self, pick: int, success: bool, part: str) -> None:
        """The device -> CPU copy of a batch (or part of it) finished or failed."""
        batch = self.batches[pick % len(self.batches)]
        keys = {"all": list(batch.keys), "first": batch.keys[:1], "last": batch.keys[-1:]}[part]
        self.finish_store(batch, keys, success)

    def finish_store(self, batch: StoreBatch, keys: list[BlockKey], success: bool) -> None:
        rows = self.rows()
        for k in keys:
            slot = self.mgr.primary.slot_of(k)
            assert slot is not None and self.stores[k] is batch
            rows[slot, :BLOCK_BYTES] = PATTERN[k] if success else JUNK
        del rows
        self.mgr.complete_store(keys, None if batch.req is None else batch.req.ctx, success=success)
        for k in keys:
            del self.stores[k]
            if success:  # readable: the wait is over
                self.waits.pop(k, None)
                self.runs.pop(k, None)
            self.abandoned.discard(k)
            batch.keys.remove(k)
            if batch.req is not None:
                batch.req.pending.discard(k)
            if success:
                assert self.mgr.primary.ref_count(k) is not None
            else:
                assert self.mgr.primary.ref_count(k) is None, f"failed store of {name(k)} left the block"
                self.present.discard(k)
        if not batch.keys:
            self.batches.remove(batch)
        submitted = self.take_submitted()
        for pos, (double, jobs) in enumerate(zip(self.doubles, submitted, strict=True)):
            cascades = [j for j in jobs if list(j.keys) == keys]
            if not success or double.failing or not self.serving(pos):
                assert not cascades, f"tier {pos + 1} got a cascade it should not"
                continue
            assert len(cascades) == 1, f"tier {pos + 1}: expected one cascade of the stored keys, got {jobs}"
            job = cascades[0]
            assert [int(s) for s in job.slots] == [self.mgr.primary.slot_of(k) for k in keys]
            assert job.request is (None if batch.req is None else batch.req.ctx)
            assert [j for j in jobs if j is not job] == [], f"tier {pos + 1} got more than the cascade"

    # --- steps and the tiers ---------------------------------------------------------------

    @rule()
    def schedule_end(self) -> None:
        polls = self.before_poll()
        groups: dict[tuple[int, str | None], list[BlockKey]] = {}
        for k, promo in self.promotions.items():
            if not promo.submitted:
                groups.setdefault((promo.tier, promo.req_id), []).append(k)
        self.mgr.on_schedule_end()
        self.after_call(polls)
        self.polled = False
        self.step_hits.clear()
        submitted = self.take_submitted()
        for (pos, req_id), keys in groups.items():
            double = self.doubles[pos]
            loads = [j for j in submitted[pos] if j.is_promotion and set(j.keys) == set(keys)]
            if double.failing:
                assert not loads
                for k in keys:
                    assert self.mgr.primary.ref_count(k) is None, f"promotion of {name(k)} not failed"
                    promo = self.promotions.pop(k)
                    self.present.discard(k)
                    self.abandoned.discard(k)
                    self.withheld[(pos, k)] = self.clock + HOLD
                    self.waits[k] = [promo.wait_began, self.clock]
                continue
            assert len(loads) == 1, f"expected one promotion job for {(pos, req_id)}, got {submitted[pos]}"
            job = loads[0]
            assert job.request is not None if req_id is not None else job.request is None
            assert len(job.keys) == len(keys)
            for k, slot in zip(job.keys, job.slots, strict=True):
                assert self.promotions[k].slot == slot
                self.promotions[k].submitted = True
        for pos, jobs in enumerate(submitted):
            extra = [j for j in jobs if not j.is_promotion]
            for job in extra:  # parked request-level cascades flushed at step end
                assert job.request is not None and job.request.params.get("request_level_tier") == pos + 1
        for double in self.doubles:
            double.polls = 0

    @rule(seconds=st.sampled_from([0.3, 0.3, 0.6, 1.2, 2.5]))
    def time_passes(self, seconds: float) -> None:
        """The engine is busy elsewhere, or a tier's load takes its time."""
        self.clock += seconds

    @rule(tier=st.integers(0, 1), count=st.integers(1, 3), outcome=st.sampled_from(["ok", "ok", "fail", "partial"]))
    def tier_runs_jobs(self, tier: int, count: int, outcome: str) -> None:
        self.doubles[tier].run_jobs(count, outcome)

    @rule(tier=st.integers(0, 1), failing=st.booleans())
    def tier_health(self, tier: int, failing: bool) -> None:
        self.doubles[tier].failing = failing

    @rule(tier=st.integers(0, 1), i=st.integers(0, len(KEYS) - 1), on=st.booleans())
    def tier_lookup_retry(self, tier: int, i: int, on: bool) -> None:
        (self.doubles[tier].retry_keys.add if on else self.doubles[tier].retry_keys.discard)(KEYS[i])

    @rule(tier=st.integers(0, 1), i=st.integers(0, len(KEYS) - 1))
    def tier_forgets(self, tier: int, i: int) -> None:
        """The tier evicts a block, unless a queued load is reading it."""
        double = self.doubles[tier]
        if not any(KEYS[i] in j.keys for j in double.queued if j.is_promotion):
            double.data.pop(KEYS[i], None)

    def tiers_busy(self) -> bool:
        return bool(self.promotions) or any(d.queued or d.finished for d in self.doubles)

    @precondition(lambda self: self.tiers_busy())
    @rule()
    def settle(self) -> None:
        """Tiers finish everything and the engine steps: every promotion ends as HIT or MISS."""
        for double in self.doubles:
            double.failing = False
        for _ in range(2):  # step 1 submits the promotions, step 2 sees them finish
            for double in self.doubles:
                double.run_jobs(len(double.queued))
            self.schedule_end()
        assert not self.promotions, f"promotions stuck: {[name(k) for k in self.promotions]}"
        for k in self.present:
            state = self.mgr.primary.lookup(k)
            assert state is HIT or k in self.stores, f"{name(k)} is {state} after settling"
        json.dumps(self.mgr.stats().as_dict())
        for event in self.mgr.take_events():
            assert event.tier in ("0:primary", "1:stateful-double", "2:stateful-double")

    @precondition(lambda self: self.present or self.tiers_busy())
    @rule(stuck=st.booleans())
    def reset_cache(self, stuck: bool) -> None:
        """Reset when the engine is idle: its device copies are done, tiers may still be busy."""
        for batch in list(self.batches):
            self.finish_store(batch, list(batch.keys), success=True)
        for req, keys, _ in self.loads:
            self.mgr.complete_load(keys, req.ctx)
        self.loads.clear()
        if stuck:
            self.doubles[1].stuck = True
            with pytest.raises(TierError):
                self.mgr.reset_cache()
            self.doubles[1].stuck = False
            assert self.mgr.jobs_in_flight() == sum(len(d.queued) + len(d.finished) for d in self.doubles)
        self.mgr.reset_cache()
        for pos, double in enumerate(self.doubles):
            assert not double.queued and not double.finished
            for job, result in double.delivered:  # a promotion that failed: the tier is not believed
                for k in set(job.keys) - set(result.succeeded(job.keys)) if job.is_promotion else ():
                    self.withheld[(pos, k)] = self.clock + HOLD
            double.delivered.clear()
            double.polls = 0
        self.take_submitted()
        assert not self.mgr.has_pending_work()
        assert self.mgr.primary.in_flight_count() == 0
        assert self.mgr.jobs_in_flight() == 0
        assert len(self.mgr.primary) == 0
        self.present.clear()
        self.promotions.clear()
        self.waits.clear()
        self.runs.clear()
        self.abandoned.clear()
        self.retrying.clear()
        self.polled = False
        self.step_hits.clear()
        for req in self.reqs:
            req.pending.clear()

    # --- invariants --------------------------------------------------------------------------

    @invariant()
    def ref_counts_and_slots(self) -> None:
        primary = self.mgr.primary
        slots: dict[int, BlockKey] = {}
        for k in KEYS:
            ref = primary.ref_count(k)
            if k not in self.present:
                assert ref is None, f"{name(k)} is in the CPU tier (ref {ref}) but the model lost it"
                continue
            assert ref is not None, f"{name(k)} vanished from the CPU tier"
            assert ref >= -1
            assert ref == self.expected_ref(k), f"{name(k)}: ref {ref}, model expects {self.expected_ref(k)}"
            slot = primary.slot_of(k)
            assert slot is not None and 0 <= slot < NUM_CPU_BLOCKS
            assert slot not in slots, f"{name(k)} and {name(slots[slot])} share row {slot}"
            slots[slot] = k
        assert len(primary) == len(self.present)
        assert primary.free_slots == NUM_CPU_BLOCKS - len(self.present)
        assert primary.in_flight_count() == len(self.stores) + len(self.promotions)
        # Every live reservation sits on its key's row: no row is reused while a job is on it.
        live: list[tuple[BlockKey, int]] = [(k, p.slot) for k, p in self.promotions.items()]
        live += [(k, s) for _, keys, ss in self.loads for k, s in zip(keys, ss, strict=True)]
        for double in self.doubles:
            for job in [*double.queued, *(j for j, _ in double.finished)]:
                if not job.is_promotion:
                    live += [(k, int(s)) for k, s in zip(job.keys, job.slots, strict=True)]
        for k, slot in live:
            holder = slots.get(slot)
            assert holder == k, f"row {slot} reserved for {name(k)} now holds {holder and name(holder)}"

    @invariant()
    def bytes_are_exact(self) -> None:
        rows = self.rows()
        for k in self.present:
            if self.expected_ref(k) >= 0:
                slot = self.mgr.primary.slot_of(k)
                assert slot is not None
                assert np.array_equal(rows[slot, :BLOCK_BYTES], PATTERN[k]), f"row of ready {name(k)} is corrupt"
        for double in self.doubles:
            for k, value in double.data.items():
                assert value == PATTERN[k].tobytes(), f"tier {double.label} holds wrong bytes for {name(k)}"

    @invariant()
    def tiers_see_the_contract(self) -> None:
        for double in self.doubles:
            assert not double.violations, double.violations
            assert double.polls <= 1, f"tier {double.label} polled {double.polls} times in one step"
        pending = any(d.queued or d.finished for d in self.doubles) or any(
            not p.submitted for p in self.promotions.values()
        )
        if pending:
            assert self.mgr.has_pending_work()
        elif not any(r.request_level_tier for r in self.reqs):
            assert not self.mgr.has_pending_work()

    @invariant()
    def finished_hooks(self) -> None:
        for req in self.reqs:
            unsubmitted = any(p.req_id == req.ctx.req_id and not p.submitted for p in self.promotions.values())
            done = req.finished and not req.pending and not unsubmitted
            for double in self.doubles:
                calls = double.finished_requests[req.ctx.req_id]
                assert calls <= 1, f"{req.ctx.req_id}: finished hook ran {calls} times on {double.label}"
                if calls:
                    assert done, f"{req.ctx.req_id}: hook ran while a store or promotion was outstanding"
                elif done and req.request_level_tier is None:
                    raise AssertionError(f"{req.ctx.req_id}: finished with nothing outstanding but no hook ran")


SETTINGS = settings(
    max_examples=400,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class LRUManagerMachine(ManagerMachine):
    policy = "lru"


class ARCManagerMachine(ManagerMachine):
    policy = "arc"


class ReturnTimeManagerMachine(ManagerMachine):
    policy = "return-time"


LRUManagerMachine.TestCase.settings = SETTINGS
ARCManagerMachine.TestCase.settings = SETTINGS
ReturnTimeManagerMachine.TestCase.settings = SETTINGS
TestManagerStatefulLRU = LRUManagerMachine.TestCase
TestManagerStatefulARC = ARCManagerMachine.TestCase
TestManagerStatefulReturnTime = ReturnTimeManagerMachine.TestCase
