"""An outside tester's state machine over TieringManager's public API, shutdown at any point included.

Where ``tests/test_manager_stateful.py`` predicts every lookup answer of a manager whose tiers
are doubles, this machine keeps a weaker model that holds whatever the policy and the real
memory tier do, and drives what that one leaves out: requests stored in pieces (a prefill in
chunks, then one block per decode step) carrying the documented hints, hostile ones included
(wrong types, NaN, inf, negative, huge strings, nested objects); misuse (bad keys, a duplicate
store, a completion with no store); ``reset_cache()`` while engine copies still run (their rows
held, then written or read late); cascades to a real memory tier (``admission: learned`` under
``return-time``) and promotions back; and ``shutdown()`` at any point, with a tier whose own
shutdown fails, then the calls after it. After every rule:

* a block the CPU tier holds as ready has the bytes of its key (a HIT is never wrong bytes);
* ref counts are never below -1, a block pinned by a device load or with a device store in
  flight is never evicted, the CPU tier never holds more blocks than its rows;
* ``stats()`` is strict JSON, counts every lookup answered, the CPU tier's blocks (held rows
  included, never past its capacity) and each tier's jobs in flight.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier import KVGeometry, LookupResult, Namespace, RequestContext, TieringManager, chain_ids
from kvtier.errors import InvalidKeyError, ManagerClosedError, RegionError, TierError, TierShutdownError
from kvtier.keys import BlockKey
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TierUsage, TransferJob
from kvtier.tiers.registry import register_tier

HIT, HIT_PENDING, RETRY, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY, LookupResult.MISS
BLOCK_BYTES = 4096
NUM_CPU_BLOCKS = 6
NAMESPACE = Namespace("audit-test", KVGeometry.from_block_bytes(BLOCK_BYTES))
CHAINS = [chain_ids(range(base, base + 8), NAMESPACE) for base in (0, 100, 200)]
CHAINS.append(CHAINS[0][:3] + chain_ids(range(300, 305), NAMESPACE))  # shares a 3-block prefix with chain 0
KEYS: list[BlockKey] = list(dict.fromkeys(k for chain in CHAINS for k in chain))
PATTERN = {k: np.frombuffer(hashlib.shake_128(k).digest(BLOCK_BYTES), dtype=np.uint8) for k in KEYS}
JUNK = np.full(BLOCK_BYTES, 0xEE, dtype=np.uint8)

HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.just("s" * 300), st.just("bad\x00id"), st.just(""),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.just([[[["deep"]]]]), st.just({"a": {"b": {"c": [1, 2]}}}), st.just(b"bytes"), st.just(object()),
)
ENGINE_OPS = ["new", "scan", "scan", "store", "store", "complete", "complete", "load_done", "finish", "step"]
HINTS = st.fixed_dictionaries({}, optional={
    "kvtier_session": st.one_of(st.sampled_from(["s1", "s2", "s3"]), HOSTILE),
    "kvtier_session_end": st.one_of(st.booleans(), HOSTILE),
    "kvtier_expected_return_s": st.one_of(st.sampled_from([0, 0.5, 3.0, 60, 86400]), HOSTILE),
    "kvtier_store": st.one_of(st.booleans(), HOSTILE),
    "kvtier_load_tiers": st.one_of(st.sampled_from(["all", "cpu", ["cpu", "memory"], "memory", []]), HOSTILE),
    "kvtier_cascade_tiers": st.one_of(st.sampled_from(["all", [], "audit-double", "local"]), HOSTILE),
})


class ShutdownFailingTier(SecondaryTier):
    """A synchronous in-memory tier whose ``shutdown()`` fails while ``fail_shutdown`` is set."""

    tier_type: ClassVar[str] = "audit-double"
    medium: ClassVar[str] = "memory"

    def __init__(self, context: TierContext) -> None:
        super().__init__(context)
        self.data: dict[BlockKey, bytes] = {}
        self.done: list[JobResult] = []
        self.fail_shutdown = False
        self.shutdown_calls = 0

    def lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        return HIT if key in self.data else MISS

    def submit_store(self, job: TransferJob) -> None:
        rows, n = self.context.rows, self.context.block_bytes
        for key, slot in zip(job.keys, job.slots, strict=True):
            self.data[key] = rows[slot, :n].tobytes()
        self.done.append(JobResult(job.job_id, True, bytes_moved=len(job.keys) * n))

    def submit_load(self, job: TransferJob) -> None:
        rows, n = self.context.rows, self.context.block_bytes
        ok = [k for k in job.keys if k in self.data]
        for key, slot in zip(job.keys, job.slots, strict=True):
            if key in self.data:
                rows[slot, :n] = np.frombuffer(self.data[key], dtype=np.uint8)
        whole = len(ok) == len(job.keys)
        self.done.append(JobResult(job.job_id, whole, None if whole else frozenset(ok), len(ok) * n))

    def poll_finished(self) -> list[JobResult]:
        done, self.done = self.done, []
        return done

    def forget(self, key: BlockKey) -> None:
        self.data.pop(key, None)

    def has_pending_work(self) -> bool:
        return False

    def usage(self) -> TierUsage:
        return TierUsage(len(self.data) * self.context.block_bytes, None, len(self.data))

    def drain(self, timeout: float | None = None) -> None:
        return

    def shutdown(self) -> None:
        self.shutdown_calls += 1
        if self.fail_shutdown:
            raise TierError("audit double: told to fail its shutdown")


register_tier("audit-double", f"{__name__}:ShutdownFailingTier")


@dataclass
class Req:
    ctx: RequestContext
    chain: list[BlockKey]
    stored: int = 0  # blocks of the chain the engine stored so far (the next store continues there)
    finished: bool = False


@dataclass
class Store:
    req: Req | None
    keys: list[BlockKey]
    slots: list[int] = field(default_factory=list)


class AuditMachine(RuleBasedStateMachine):
    policy: ClassVar[str] = "return-time"
    admission: ClassVar[str] = "all"  # the memory tier's cascade admission

    def __init__(self) -> None:
        super().__init__()
        self.mgr = TieringManager.create(
            namespace=NAMESPACE, num_cpu_blocks=NUM_CPU_BLOCKS, policy=self.policy, sweep_stale=False,
            tiers=[{"type": "audit-double"},
                   {"type": "memory", "max_bytes": 4 * (BLOCK_BYTES + 512), "admission": self.admission}],
            drain_timeout=10.0, shutdown_timeout=10.0,
        )
        self.double = self.mgr.tiers[0]
        assert isinstance(self.double, ShutdownFailingTier)
        self.region = self.mgr.region
        self.reqs: list[Req] = []
        self.stores: list[Store] = []
        self.loads: list[tuple[Req, list[BlockKey]]] = []
        self.answers = 0  # lookup answers the manager gave
        self.next_id = 0
        self.closed = False
        self.failed_shutdown = False
        self.late_writes: list[int] = []  # rows a device store started before a reset may still write
        self.late_reads: list[tuple[int, np.ndarray]] = []  # rows a device load may still read, and their bytes
        self.steps_since_reset = 0
        self.steps = 0  # rules run (shutdown comes after a few)

    def teardown(self) -> None:
        self.double.fail_shutdown = False
        self.loads.clear()
        gc.collect()
        self.mgr.shutdown()
        assert self.region.closed

    # --- helpers ---------------------------------------------------------------------------

    def pins(self) -> dict[BlockKey, int]:
        out: dict[BlockKey, int] = {}
        for _, keys in self.loads:
            for k in keys:
                out[k] = out.get(k, 0) + 1
        return out

    def in_flight(self) -> set[BlockKey]:
        return {k for s in self.stores for k in s.keys}

    def active(self) -> list[Req]:
        return [r for r in self.reqs if not r.finished]

    # --- rules ------------------------------------------------------------------------------

    @precondition(lambda self: not self.closed and len(self.active()) < 4)
    @rule(chain=st.integers(0, len(CHAINS) - 1), params=HINTS, announce=st.booleans())
    def new_request(self, chain: int, params: dict[str, Any], announce: bool) -> None:
        self.next_id += 1
        req = Req(RequestContext(f"r{self.next_id}", params), CHAINS[chain])
        if announce:
            self.mgr.on_new_request(req.ctx)
        self.reqs.append(req)

    @precondition(lambda self: not self.closed and self.active())
    @rule(pick=st.integers(0, 99))
    def scan_and_load(self, pick: int) -> None:
        req = self.active()[pick % len(self.active())]
        scan = self.mgr.lookup_prefix(req.chain, req.ctx)
        self.answers += len(scan.answers)
        if scan.ready:
            self.load(req, req.chain[: scan.ready])

    @precondition(lambda self: not self.closed and self.active())
    @rule(pick=st.integers(0, 99), i=st.integers(0, len(KEYS) - 1))
    def lookup_one(self, pick: int, i: int) -> None:
        req = self.active()[pick % len(self.active())]
        if self.mgr.lookup(KEYS[i], req.ctx) is HIT:
            self.load(req, [KEYS[i]])
        self.answers += 1

    def load(self, req: Req, keys: list[BlockKey]) -> None:
        slots = self.mgr.prepare_load(keys, req.ctx)
        rows = self.mgr.rows
        for k, s in zip(keys, slots, strict=True):
            assert np.array_equal(rows[s, :BLOCK_BYTES], PATTERN[k]), "a HIT was loaded with wrong bytes"
        del rows
        self.loads.append((req, keys))

    @precondition(lambda self: not self.closed and self.loads)
    @rule(pick=st.integers(0, 99))
    def complete_load(self, pick: int) -> None:
        req, keys = self.loads.pop(pick % len(self.loads))
        self.mgr.complete_load(keys, req.ctx)

    @precondition(lambda self: not self.closed and any(r.stored < len(r.chain) for r in self.active()))
    @rule(pick=st.integers(0, 99), size=st.sampled_from([1, 1, 2, 3, 8]))
    def store_piece(self, pick: int, size: int) -> None:
        """The request's next chunk (a prefill chunk, or one decoded block)."""
        reqs = [r for r in self.active() if r.stored < len(r.chain)]
        req = reqs[pick % len(reqs)]
        keys = req.chain[req.stored : req.stored + size]
        busy = self.in_flight()
        result = self.mgr.prepare_store(keys, req.ctx)
        if result is None:
            return
        req.stored += len(keys)
        assert not set(result.evicted_keys) & (set(keys) | busy | set(self.pins())), "evicted a busy block"
        new = list(result.keys_to_store)
        assert not set(new) & busy, "a key with a store in flight was handed out again"
        assert len(set(int(s) for s in result.slots)) == len(new)
        if new:
            self.stores.append(Store(req, new, [int(s) for s in result.slots]))

    @precondition(lambda self: not self.closed and self.stores)
    @rule(pick=st.integers(0, 99), success=st.sampled_from([True, True, True, False]), part=st.booleans())
    def complete_store(self, pick: int, success: bool, part: bool) -> None:
        store = self.stores[pick % len(self.stores)]
        keys = store.keys[:1] if part else list(store.keys)
        rows = self.mgr.rows
        for k in keys:
            slot = self.mgr.primary.slot_of(k)
            assert slot == store.slots[store.keys.index(k)], "a row reserved for a store moved"
            rows[slot, :BLOCK_BYTES] = PATTERN[k] if success else JUNK
        del rows
        self.mgr.complete_store(keys, None if store.req is None else store.req.ctx, success=success)
        for k in keys:
            i = store.keys.index(k)
            del store.keys[i], store.slots[i]
            if not success:
                assert self.mgr.primary.ref_count(k) is None, "a failed store left its block"
        if not store.keys:
            self.stores.remove(store)

    @precondition(lambda self: not self.closed and self.active())
    @rule(pick=st.integers(0, 99))
    def finish_request(self, pick: int) -> None:
        req = self.active()[pick % len(self.active())]
        req.finished = True
        self.mgr.on_request_finished(req.ctx)

    @precondition(lambda self: not self.closed)
    @rule()
    def schedule_end(self) -> None:
        if self.steps_since_reset >= self.mgr.primary.reset_hold_steps - 1:
            self.late_copies_land()  # the last step of the hold: the engine's copies are done by its end
        self.mgr.on_schedule_end()
        self.steps_since_reset += 1
        json.dumps(self.mgr.stats().as_dict())

    @precondition(lambda self: not self.closed)
    @rule(plan=st.lists(st.tuples(st.sampled_from(ENGINE_OPS), st.integers(0, 99)), min_size=4, max_size=16),
          params=HINTS)
    def engine_steps(self, plan: list[tuple[str, int]], params: dict[str, Any]) -> None:
        """A run of what an engine does (the rules above, densely): new requests, prefix scans and
        loads, stores in pieces and their completions, finished requests, step ends."""
        for op, pick in plan:
            if op == "new" and len(self.active()) < 4:
                self.new_request(pick % len(CHAINS), params if pick % 3 == 0 else {}, bool(pick % 2))
            elif op == "scan" and self.active():
                self.scan_and_load(pick)
            elif op == "store" and any(r.stored < len(r.chain) for r in self.active()):
                self.store_piece(pick, [1, 1, 2, 3, 8][pick % 5])
            elif op == "complete" and self.stores:
                self.complete_store(pick, pick % 10 != 0, pick % 4 == 0)
            elif op == "load_done" and self.loads:
                self.complete_load(pick)
            elif op == "finish" and self.active():
                self.finish_request(pick)
            elif op == "step":
                self.schedule_end()
            self.a_settle_the_memory_tier()  # each op sees the tier's jobs done, as the rules do

    @precondition(lambda self: not self.closed)
    @rule(i=st.integers(0, len(KEYS) - 1))
    def secondary_forgets(self, i: int) -> None:
        self.double.forget(KEYS[i])

    @precondition(lambda self: not self.closed)
    @rule(bad=st.sampled_from([b"", b"x" * 65, "text", 7, None, bytearray(b"k"), [b"k"], 1.5]))
    def bad_key(self, bad: Any) -> None:
        for call in (self.mgr.lookup, lambda k: self.mgr.prepare_store([k]), lambda k: self.mgr.complete_store([k]),
                     lambda k: self.mgr.touch([k]), lambda k: self.mgr.prepare_load([k]),
                     lambda k: self.mgr.complete_load([k]), lambda k: self.mgr.lookup_prefix([k])):
            with pytest.raises(InvalidKeyError):
                call(bad)

    @precondition(lambda self: not self.closed)
    @rule(i=st.integers(0, len(KEYS) - 1))
    def stray_completion(self, i: int) -> None:
        """A completion with no store of the key outstanding changes nothing."""
        k = KEYS[i]
        if k in self.in_flight():
            return
        before = self.mgr.primary.ref_count(k)
        self.mgr.complete_store([k], success=bool(i % 2))
        assert self.mgr.primary.ref_count(k) == before

    @precondition(lambda self: not self.closed)
    @rule()
    def reset(self) -> None:
        """A reset while engine copies may still run: their rows are held until they finish."""
        self.late_writes += [slot for store in self.stores for slot in store.slots]
        rows = self.mgr.rows
        for _, keys in self.loads:
            for k in keys:
                slot = self.mgr.primary.slot_of(k)
                assert slot is not None
                self.late_reads.append((slot, rows[slot, :BLOCK_BYTES].copy()))
        del rows
        self.stores.clear()
        self.loads.clear()  # the engine drops the completions of copies started before the reset
        self.mgr.reset_cache()
        self.steps_since_reset = 0
        assert len(self.mgr.primary) == 0 and not self.mgr.has_pending_work()

    @precondition(lambda self: not self.closed and (self.late_writes or self.late_reads))
    @rule()
    def late_copies_land(self) -> None:
        """The engine's copies started before the reset finish within the hold (3 engine steps)."""
        rows = self.mgr.rows
        for slot in self.late_writes:
            rows[slot, :BLOCK_BYTES] = JUNK
        for slot, seen in self.late_reads:
            assert np.array_equal(rows[slot, :BLOCK_BYTES], seen), "a row a device load reads was reused"
        del rows
        self.late_writes.clear()
        self.late_reads.clear()

    @precondition(lambda self: not self.closed and self.steps >= 25)
    @rule(fail=st.booleans())
    def shutdown(self, fail: bool) -> None:
        """Shutdown at any point, engine copies in flight or not; a failing tier keeps the rows."""
        self.double.fail_shutdown = fail
        if fail:
            with pytest.raises(TierShutdownError) as caught:
                self.mgr.shutdown()
            assert "tier #1 (type=audit-double, class=ShutdownFailingTier)" in str(caught.value)
            assert not self.region.closed and self.mgr.rows is not None  # still mapped: a tier may use it
            assert not self.mgr.is_shut_down
            self.failed_shutdown = True
            self.double.fail_shutdown = False
        self.loads.clear()
        self.stores.clear()
        gc.collect()
        self.mgr.shutdown()
        self.closed = True
        assert self.mgr.is_shut_down and self.region.closed
        self.mgr.shutdown()  # a no-op now

    @precondition(lambda self: self.closed)
    @rule(i=st.integers(0, len(KEYS) - 1))
    def after_shutdown(self, i: int) -> None:
        k, ctx, mgr = KEYS[i], RequestContext("late"), self.mgr
        calls: dict[str, Any] = {
            "lookup": lambda: mgr.lookup(k), "lookup_prefix": lambda: mgr.lookup_prefix([k]),
            "prepare_load": lambda: mgr.prepare_load([k]), "complete_load": lambda: mgr.complete_load([k]),
            "touch": lambda: mgr.touch([k]), "prepare_store": lambda: mgr.prepare_store([k]),
            "complete_store": lambda: mgr.complete_store([k]), "on_new_request": lambda: mgr.on_new_request(ctx),
            "on_request_finished": lambda: mgr.on_request_finished(ctx), "on_schedule_end": mgr.on_schedule_end,
            "has_pending_work": mgr.has_pending_work, "take_events": mgr.take_events,
            "jobs_in_flight": mgr.jobs_in_flight, "reset_cache": mgr.reset_cache,
        }
        for name, call in calls.items():
            with pytest.raises(ManagerClosedError, match=name):
                call()
        with pytest.raises(RegionError):
            self.mgr.rows  # noqa: B018
        json.dumps(self.mgr.stats().as_dict())
        assert self.mgr.tier_label(1) == "1:audit-double" and len(self.mgr.tier_descriptors()) == 3
        assert self.mgr.request_control(RequestContext("late2", {"kvtier_store": False})).store is False
        assert self.mgr.block_bytes == BLOCK_BYTES and self.mgr.is_idle in (True, False)
        self.mgr.telemetry  # noqa: B018

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def a_settle_the_memory_tier(self) -> None:
        """Every job of the (threaded) memory tier finished before the next rule (invariants run
        in name order: this one first), so what the next rule sees (a HIT or a HIT_PENDING, a
        load to complete) does not depend on its threads' timing: hypothesis needs the same
        draws to give the same run (else FlakyStrategyDefinition)."""
        if not self.closed:
            self.mgr.tiers[1].drain(10.0)

    @invariant()
    def cpu_tier_is_sound(self) -> None:
        self.steps += 1
        if self.closed:
            return
        primary, rows = self.mgr.primary, self.mgr.rows
        assert len(primary) <= NUM_CPU_BLOCKS
        pins, busy = self.pins(), self.in_flight()
        for k in KEYS:
            ref = primary.ref_count(k)
            if k in busy:
                assert ref == -1, f"a block with a device store in flight has ref {ref}"
            elif k in pins:
                assert ref is not None and ref >= pins[k], f"a block pinned {pins[k]}x by loads has ref {ref}"
            if ref is None:
                continue
            assert ref >= -1
            if ref >= 0:
                slot = primary.slot_of(k)
                assert np.array_equal(rows[slot, :BLOCK_BYTES], PATTERN[k]), "a ready block has wrong bytes"
        del rows

    @invariant()
    def stats_are_consistent(self) -> None:
        snap = self.mgr.stats()
        as_dict = json.loads(json.dumps(snap.as_dict(), allow_nan=False))
        assert as_dict
        assert sum(snap.manager.lookups.values()) == self.answers
        if not self.closed:
            assert snap.cpu.entries == len(self.mgr.primary) <= snap.cpu_blocks
            assert len(self.mgr.primary) + self.mgr.primary.held_count <= NUM_CPU_BLOCKS
            assert snap.cpu.used_bytes is not None and snap.cpu.capacity_bytes is not None
            assert snap.cpu.used_bytes <= snap.cpu.capacity_bytes
        for problems in snap.manager.request_control_problems.values():
            assert problems > 0
        assert snap.cpu.lookups.hit == snap.manager.lookups["hit"]
        in_flight = 0
        for tier in snap.secondary:
            assert tier.stores_in_flight >= 0 and tier.loads_in_flight >= 0
            assert all(n >= 0 for n in tier.failures.values())
            in_flight += tier.stores_in_flight + tier.loads_in_flight
        assert snap.manager.jobs_in_flight == in_flight


SETTINGS = settings(max_examples=60, stateful_step_count=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


class LRUAudit(AuditMachine):
    policy = "lru"


class ARCAudit(AuditMachine):
    policy = "arc"


class ReturnTimeAudit(AuditMachine):
    policy = "return-time"
    admission = "learned"


LRUAudit.TestCase.settings = SETTINGS
ARCAudit.TestCase.settings = SETTINGS
ReturnTimeAudit.TestCase.settings = SETTINGS
TestAuditLRU = pytest.mark.slow(LRUAudit.TestCase)  # ~25 s each on the 2-core machine
TestAuditARC = pytest.mark.slow(ARCAudit.TestCase)
TestAuditReturnTime = pytest.mark.slow(ReturnTimeAudit.TestCase)


def test_shutdown_failure_is_logged_with_index_type_and_class(caplog: pytest.LogCaptureFixture) -> None:
    mgr = TieringManager.create(namespace=NAMESPACE, num_cpu_blocks=2, sweep_stale=False,
                                tiers=[{"type": "memory"}, {"type": "audit-double"}])
    double = mgr.tiers[1]
    assert isinstance(double, ShutdownFailingTier)
    double.fail_shutdown = True
    with caplog.at_level(logging.ERROR), pytest.raises(TierShutdownError):
        mgr.shutdown()
    text = caplog.text
    assert "#2 (type=audit-double, class=ShutdownFailingTier)" in text
    assert not mgr.region.closed and math.isfinite(mgr.stats().taken_at)
    double.fail_shutdown = False
    mgr.shutdown()
    assert mgr.region.closed and double.shutdown_calls == 2


@pytest.mark.parametrize(
    "setting",
    [{"enabled": "false"}, {"enabled": None}, {"enabled": 0}, {"smoothing": "0.3"}, {"smoothing": None},
     {"smoothing": True}],
    ids=["enabled-str", "enabled-none", "enabled-0", "smoothing-str", "smoothing-none", "smoothing-bool"],
)
def test_backpressure_settings_refuse_what_is_not_their_type(setting: dict[str, Any]) -> None:
    """Regression (audit, 2026-12-05): ``enabled="false"`` switched backpressure on (any value was
    taken by its truth) and a ``smoothing`` that is no number raised a bare TypeError from a
    comparison, where every other setting raises ConfigError naming itself."""
    from kvtier.backpressure import BackpressureSettings
    from kvtier.errors import ConfigError

    name = next(iter(setting))
    with pytest.raises(ConfigError, match=f"backpressure {name} must be"):
        BackpressureSettings(**setting)
    assert BackpressureSettings(enabled=False, smoothing=1).smoothing == 1
