"""TieringManager: the scheduler-side orchestrator of the CPU tier and the secondary tiers.

Every method except :meth:`reset_cache` and :meth:`shutdown` is called from
the engine's scheduler thread and does bookkeeping only: it never moves bytes
and never blocks on I/O. Bytes move in engine workers (device <-> CPU rows)
and in each secondary tier's I/O threads (CPU rows <-> tier), which report
completion through ``poll_finished``.

Contract per engine step (DESIGN.md section 5):

* Tier jobs are polled at most once per step, at the first ``lookup``,
  ``prepare_load`` or ``prepare_store`` of the step (or in ``on_schedule_end``),
  so pins released by finished cascades count in the eviction decisions.
* ``lookup`` answers HIT / HIT_PENDING / RETRY / MISS. On a CPU miss the
  secondary tiers are asked in order; on the first secondary HIT a CPU row is
  reserved at once (a second lookup of the key, from any request, sees
  HIT_PENDING) and the load is submitted in ``on_schedule_end``, batched per
  (tier, request). If no row can be reserved the answer is MISS.
* ``complete_store(success=True)`` cascades the stored blocks to every
  secondary tier that admits them, pinning their rows once per tier until that
  tier reports the job. A failed store cascades nothing.
* A tier's ``on_request_finished`` runs only once the request finished and no
  device store of it is still outstanding (no more cascades can be issued).
* Admission (:mod:`kvtier.manager.admission`; by default backpressure,
  :mod:`kvtier.backpressure`): a tier whose cascade jobs got slow gets no new
  cascades until they are fast again; loads and promotions never wait.
* Per-request control (:mod:`kvtier.request_control`): a request's params may
  restrict the tiers it loads from, whether its blocks are stored, and the
  tiers they cascade to.
* :meth:`TieringManager.stats` returns a typed snapshot of every tier: its own
  counters plus what the manager observed (:mod:`kvtier.manager.snapshot`).

The boundary: every method taking keys accepts ``bytes`` keys of 1 to
:data:`~kvtier.tiers.format.MAX_KEY_BYTES` bytes and raises
:class:`~kvtier.errors.InvalidKeyError` at the call for anything else (nothing
reaches a tier). Once :meth:`TieringManager.shutdown` was called, every method
except ``shutdown``, ``is_shut_down`` and ``stats`` raises
:class:`~kvtier.errors.ManagerClosedError`. ``stats`` never raises because a
tier misbehaves. Secondary tiers are numbered from 1 in logs, labels and
errors; the CPU tier is 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from functools import partial
from time import perf_counter
from typing import Any

import numpy as np

from kvtier.backpressure import BackpressureSettings
from kvtier.errors import InvalidKeyError, ManagerClosedError, TierShutdownError
from kvtier.keys import BlockKey, Namespace
from kvtier.manager import build, scan, snapshot
from kvtier.manager.handle import TierHandle
from kvtier.manager.ledger import Ledger
from kvtier.manager.requests import RequestTable
from kvtier.manager.snapshot import LookupTally
from kvtier.manager.step_hits import LOOKUP_TIMING_EVERY, StepHits
from kvtier.manager.tierset import TierSet
from kvtier.manager.waits import DEFAULT_FAILED_LOAD_SECONDS, DEFAULT_WAIT_TIMEOUT, BlockWaits
from kvtier.policies import DEFAULT_POLICY
from kvtier.primary import IN_FLIGHT, PrepareStoreResult, PrimaryTier
from kvtier.region import SharedRegion
from kvtier.request_control import TierDescriptor
from kvtier.telemetry import ManagerCounters, ManagerSnapshot, TierTelemetry
from kvtier.tiers.base import SecondaryTier, checked_answers
from kvtier.tiers.format import MAX_KEY_BYTES
from kvtier.types import (
    DEFAULT_CONTROL,
    PRIMARY_LABEL,
    BlockEvent,
    LookupResult,
    OffloadPolicy,
    PrefixLookup,
    RequestContext,
    RequestControl,
    tier_label,
)

# The answers as module constants: the hot paths compare against them without an attribute load.
_HIT, _HIT_PENDING, _RETRY, _MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY, LookupResult.MISS


def _plain_keys(keys: list[BlockKey]) -> list[BlockKey]:
    """``keys`` checked one by one, each a plain ``bytes`` of 1..MAX_KEY_BYTES bytes: a bytes
    subclass's key is copied to plain bytes (its own ``len``, hash and equality never take part);
    anything else raises :class:`InvalidKeyError`."""
    plain: list[BlockKey] = []
    for key in keys:
        if not isinstance(key, bytes):
            raise InvalidKeyError.of(key, MAX_KEY_BYTES)
        if type(key) is not bytes:
            key = bytes(memoryview(key))
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise InvalidKeyError.of(key, MAX_KEY_BYTES)
        plain.append(key)
    return plain


class TieringManager:
    """Coordinates a :class:`PrimaryTier` with secondary tiers; see the module docstring.

    Build one with :meth:`create` (which also makes the shared region and the tiers), or
    pass ready parts. The manager owns the parts it is given: :meth:`shutdown` shuts them down.
    """

    def __init__(
        self,
        primary: PrimaryTier,
        tiers: Sequence[SecondaryTier] = (),
        *,
        drain_timeout: float | None = 120.0,
        shutdown_timeout: float | None = build.DEFAULT_SHUTDOWN_TIMEOUT,
        backpressure: BackpressureSettings | None = None,
        lookup_timing_every: int = LOOKUP_TIMING_EVERY,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
        failed_load_seconds: float = DEFAULT_FAILED_LOAD_SECONDS,
    ) -> None:
        """``wait_timeout``: the longest a lookup keeps a request waiting on one block (RETRY,
        HIT_PENDING) before it answers MISS; ``failed_load_seconds``: how long a tier is not
        believed about a block after its promise for it failed (:mod:`kvtier.manager.waits`);
        ``lookup_timing_every``: one engine step with lookups in this many has its first
        lookups timed for the per-tier latency histograms (see :data:`LOOKUP_TIMING_EVERY`)."""
        hold = build.check_settings(shutdown_timeout, drain_timeout, lookup_timing_every, wait_timeout,
                                    failed_load_seconds)
        self.primary = primary
        self.tiers: list[SecondaryTier] = list(tiers)
        self.drain_timeout = drain_timeout
        self.shutdown_timeout = shutdown_timeout
        self.wait_timeout = float(wait_timeout)
        self.backpressure = backpressure if backpressure is not None else BackpressureSettings()
        self.lookup_timing_every = lookup_timing_every
        cpu = TierTelemetry()
        self._waits = BlockWaits(self.wait_timeout, hold, cpu, primary.num_blocks)
        self._tiers = TierSet(self.tiers, self.backpressure, ManagerCounters(), self._waits, cpu, primary)
        self._jobs = Ledger(primary, self._tiers.counters, self._tiers, self._waits, self.wait_timeout)
        cpu_tier = TierDescriptor(0, PRIMARY_LABEL, "primary", "local")
        self._requests = RequestTable([cpu_tier, *(h.descriptor for h in self._tiers.handles)], self._tiers,
                                      primary, self._jobs, self.wait_timeout)
        self._closing = False  # shutdown() was called: only the calls that read what it knows remain
        self._steady = False  # this step was polled (the manager is open)
        # The lookup fast path (see lookup): True in a polled step whose lookups are not timed;
        # it then answers a CPU hit from the CPU tier's index without a call.
        self._fast = False
        self._slot_get, self._refs = primary.hot_path()
        self._hits = StepHits()
        self._step_hit = self._hits.log.append
        self._tally = LookupTally()
        self.promoted_from = 0
        """After a lookup answered HIT_PENDING: the index of the secondary tier it started a
        promotion from, or 0 if the block was already being written into the CPU tier (a device
        store or an earlier promotion). Meaningless after other answers. Lets an engine adapter
        tell where a hit came from without a second lookup."""

    @classmethod
    def create(
        cls, *, namespace: Namespace, block_bytes: int | None = None, num_cpu_blocks: int | None = None,
        cpu_bytes: int | str | None = None, policy: str = DEFAULT_POLICY, tiers: Sequence[dict[str, Any]] = (),
        region_name: str | None = None, shm_dir: str | os.PathLike[str] = "/dev/shm", expected_mappers: int = 1,
        prefault: bool = True, pin: bool = False, sweep_stale: bool = True, drain_timeout: float | None = 120.0,
        shutdown_timeout: float | None = build.DEFAULT_SHUTDOWN_TIMEOUT,
        backpressure: BackpressureSettings | None = None, events: bool = True,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT, failed_load_seconds: float = DEFAULT_FAILED_LOAD_SECONDS,
    ) -> TieringManager:
        """Build the region, the CPU tier and each secondary tier (``{"type": ..., **options}``).

        ``block_bytes`` is the payload of one block (one CPU row before page rounding);
        by default the namespace's geometry gives it. If any step fails, the tiers built
        are shut down in reverse order, the region is released, and the original error
        is raised (:mod:`kvtier.manager.build`). ``backpressure`` (default: on) decides when
        cascades to a slow tier are skipped. ``events=False``: the CPU tier records no
        stored/removed events for :meth:`take_events` (for an engine that never takes
        them), sparing an allocation per eviction.
        """
        build.check_arguments(namespace, policy, tiers, region_name, expected_mappers, backpressure,
                              {"prefault": prefault, "pin": pin, "sweep_stale": sweep_stale, "events": events})
        block_bytes, num_cpu_blocks = build.sizes(namespace, block_bytes, num_cpu_blocks, cpu_bytes)
        build.check_settings(shutdown_timeout, drain_timeout, 1, wait_timeout, failed_load_seconds)
        build.check_policy_and_tiers(policy, tiers)
        region = build.new_region(region_name, num_cpu_blocks, block_bytes, shm_dir, expected_mappers=expected_mappers,
                                  prefault=prefault, pin=pin, sweep_stale=sweep_stale)
        return build.assemble(region, block_bytes, policy, tiers, namespace, events, lambda primary, built: cls(
            primary, built, drain_timeout=drain_timeout, shutdown_timeout=shutdown_timeout, backpressure=backpressure,
            wait_timeout=wait_timeout, failed_load_seconds=failed_load_seconds), shutdown_timeout)

    @property
    def region(self) -> SharedRegion:
        return self.primary.region

    @property
    def rows(self) -> np.ndarray:
        """A ``(num_blocks, row_stride)`` uint8 view of the CPU rows (for workers in this process)."""
        return self.region.rows

    @property
    def block_bytes(self) -> int:
        return self.primary.block_bytes

    def tier_label(self, index: int) -> str:
        """``"0:primary"`` or ``"<n>:<type>"`` for secondary tier n (1-based); IndexError for no tier."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= len(self.tiers):
            raise IndexError(f"tier index {index!r}: this manager's tiers are 0 (the CPU tier) to {len(self.tiers)}")
        return tier_label(index, "primary" if index == 0 else self.tiers[index - 1].tier_type)

    def _open_keys(self, call: str, keys: Iterable[BlockKey], request: Any = None,
                   success: Any = True) -> list[BlockKey]:  # fmt: skip
        """``keys`` as a list, each key checked (the call's other arguments: :func:`build.bad_call`)."""
        if self._closing:
            raise ManagerClosedError.of(call)
        if (type(keys) is not list or (request is not None and type(request) is not RequestContext)
                or success is not True) and (wrong := build.bad_call(call, keys, request, success)):  # fmt: skip
            raise wrong
        out = keys if type(keys) is list else list(keys)
        for key in out:
            if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
                return _plain_keys(out)  # raises, or copies a bytes subclass's keys to plain bytes
        return out

    def _poll_once(self) -> None:
        """The step's poll of the tiers' jobs, at its first call that needs it (never after shutdown)."""
        if not self._steady:
            self._steady = True
            self._jobs.poll(self._tiers.live)

    def lookup(self, key: BlockKey, request: RequestContext | None = None) -> LookupResult:
        """Where is ``key``? Starts a promotion on a secondary hit (see the module docstring).

        A CPU hit is answered from the CPU tier's index, without a call per tier;
        misses ask the secondary tiers. :meth:`lookup_prefix` answers a request's
        run of keys in one call.

        This method answers the common cases itself, a hot-path copy of :meth:`_answer`:
        in a step already polled and not timed, for a request with the default control, a
        ready CPU block is answered here (its key logged, which is how HITs are counted) and
        a CPU miss goes straight to the secondary tiers; in a timed step such a lookup skips
        the checks :meth:`_lookup` makes (a timed step times its first lookups only, see
        :data:`~kvtier.manager.step_hits.TIMED_LOOKUPS`). ``bench_vs_vllm``'s HIT loop: 1.11-1.32x
        the floor's bare ``dict.get`` and row read (three runs); a step of untimed HITs 1.02-1.10x.
        """
        try:
            plain = request is None or request.control is DEFAULT_CONTROL
        except AttributeError:
            raise TypeError(f"request must be a RequestContext (or None), got {type(request).__name__}") from None
        if type(key) is bytes and plain:
            if self._fast:
                slot = self._slot_get(key)
                if slot is not None:  # the key equals a stored one, so its length was checked
                    if self._refs[slot] != IN_FLIGHT:
                        self._step_hit(key)
                        return _HIT
                elif 0 < len(key) <= MAX_KEY_BYTES:
                    found = self._tiers.lookup(key, request, None, 0.0)
                    if found is _MISS:
                        self._tally.miss += 1
                        return self._waits.missed(key)
                    return self._found(key, request, found)
            elif self._hits.timed and 0 < len(key) <= MAX_KEY_BYTES:
                return self._answer(key, request, None)
        return self._lookup(key, request)

    def _lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        """:meth:`lookup` in full: the checks, the step's poll and the request's control, then
        :meth:`_answer`."""
        if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES or self._closing:
            key = self._open_keys("lookup", (key,))[0]  # raises, unless a valid key of a bytes subclass
        if not (self._fast or self._hits.timed):  # the step's first lookup
            self._poll_once()
            self._fast = self._hits.first_lookup(self.lookup_timing_every)
        allowed = None if request is None else (request.control or self.request_control(request)).load_from
        if allowed is not None and 0 not in allowed:
            self._tally.unasked += 1
            self._tally.miss += 1
            return _MISS  # the request may not load anything: every load goes through the CPU tier
        return self._answer(key, request, allowed)

    def _answer(self, key: BlockKey, request: RequestContext | None, allowed: frozenset[int] | None) -> LookupResult:
        """The CPU tier's answer to a checked lookup in a polled step (timed in a timed step), then
        the secondary tiers' (those ``allowed``; None: all)."""
        start = now = 0.0
        if self._hits.timed:
            start = perf_counter()
        slot = self._slot_get(key)
        if start:
            now = perf_counter()
            self._tiers.cpu.lookup_seconds.pending.append(now - start)
            if self._hits.sampled():  # the step's sample is taken: its other lookups go fast
                self._fast = True
        if slot is not None:
            if self._refs[slot] == IN_FLIGHT:
                self._tally.cpu_pending += 1
                if not self._waits.pending(key, slot, now):  # waited on past the deadline
                    self._tally.miss += 1
                    return _MISS
                self._tally.pending += 1
                self.promoted_from = 0
                return _HIT_PENDING
            self._step_hit(key)
            return _HIT
        found = self._tiers.lookup(key, request, allowed, now)
        if found is _MISS:
            self._tally.miss += 1
            return self._waits.missed(key)
        return self._found(key, request, found)

    def _found(self, key: BlockKey, request: RequestContext | None, found: TierHandle | LookupResult) -> LookupResult:
        """The answer after a CPU miss that the secondary tiers did not answer MISS: RETRY, or a
        HIT in ``found``'s tier, which reserves a CPU row for ``key`` and queues its load for step
        end (MISS if no row can be freed, whatever other tiers said)."""
        if not isinstance(found, TierHandle):
            if not self._waits.retrying(key):  # waited on past the deadline
                self._tally.miss += 1
                return _MISS
            self._tally.retry += 1
            return _RETRY
        if self._waits.since and not self._waits.promoting(key):  # its wait is already past the deadline
            self._tally.miss += 1
            return _MISS
        slot = self.primary.reserve_one(key, self._hits.protected())
        if slot is None:
            self._tiers.counters.promotion_alloc_failures += 1
            self._tally.miss += 1
            return self._waits.missed(key)
        if self._jobs.queue_promotion(found, key, slot, request):
            state = self._requests.state(request)
            if state is not None:
                self._requests.list_for_step(state)
        self._tiers.counters.promotions_started += 1
        self.promoted_from = found.index
        self._tally.pending += 1
        return _HIT_PENDING

    def lookup_prefix(self, keys: Sequence[BlockKey], request: RequestContext | None = None) -> PrefixLookup:
        """Look up a request's blocks in prefix order, in one call: the engine's prefix scan.

        Same answers and the same effects (promotions started, counters, the
        step's HITs protected from eviction) as calling :meth:`lookup` on each
        key in order, stopping after the first MISS, as vLLM's connector does
        with ``lookup``; a run of CPU hits costs about a dictionary probe per
        key. Returns a :class:`~kvtier.types.PrefixLookup`: the answers, how
        many leading keys are ready to load now (``ready``), and whether to ask
        again next step (``deferred``: a key before the first MISS answered
        HIT_PENDING or RETRY). A bad key raises like :meth:`lookup`, after the
        keys before it were looked up. Scheduler thread only; never blocks.
        """
        if self._closing:
            raise ManagerClosedError.of("lookup_prefix")
        if (type(keys) is not list and type(keys) is not tuple) or (request is not None and type(request) is not
                                                                    RequestContext):  # fmt: skip
            keys = build.listed("lookup_prefix", keys, request)
        answers: list[LookupResult] = []
        n = len(keys)
        i = 0
        ready = -1  # the index of the first answer other than HIT, once known
        while i < n:
            i = self._lookup_run(keys, i, request, answers)
            if i < n:
                answer = self._lookup(keys[i], request)
                answers.append(answer)
                i += 1
                if answer is not _HIT:
                    if ready < 0:
                        ready = i - 1
                    if answer is _MISS:
                        break
        if ready < 0:  # every key answered HIT
            return PrefixLookup(answers, n, n, False)
        hits, pending = answers.count(_HIT), answers.count(_HIT_PENDING)
        return PrefixLookup(answers, ready, hits + pending, bool(pending) or _RETRY in answers)

    def _lookup_run(
        self, keys: Sequence[BlockKey], i: int, request: RequestContext | None, answers: list[LookupResult]
    ) -> int:
        """Answer the CPU hits of :meth:`lookup_prefix` from ``keys[i]`` on, in C-level passes
        (:mod:`kvtier.manager.scan`; in a timed step those a lookup per key would time get the
        run's time per key as their sample); the index of the first key :meth:`_lookup` must answer."""
        if not (self._fast or self._hits.timed) or not (request is None or request.control is DEFAULT_CONTROL):
            return i
        began = perf_counter() if self._hits.timed else 0.0
        found = scan.ready_run(self._slot_get, self._refs, IN_FLIGHT, keys, i)
        if found:
            self._hits.log.extend(keys[i : i + found])
            answers += [_HIT] * found
            if began:
                timed = min(found, self._hits.samples)  # as many as a lookup per key would time
                self._tiers.cpu.lookup_seconds.pending.extend([(perf_counter() - began) / found] * timed)
                if self._hits.sampled(timed):
                    self._fast = True
        return i + found

    def prepare_load(self, keys: Sequence[BlockKey], request: RequestContext | None = None) -> np.ndarray:
        """Pin HIT blocks for a device load; returns their CPU rows. Raises if one is not HIT. The
        secondary tiers are touched with ``keys`` (vLLM calls :meth:`touch` for none): a block the
        CPU tier serves keeps its place in the tiers behind it (their recency, a TTL)."""
        keys = self._open_keys("prepare_load", keys, request)
        self._poll_once()
        state = self._requests.find(request)
        rows = self.primary.prepare_load(keys, state.chain_tail if state else None, request and request.req_id)
        self._tiers.touch(keys, request, self.request_control)
        if state is not None and keys:
            state.chain_tail = keys[-1]
            state.stored_tail = False
        self._tiers.cpu.read.add(len(keys), len(keys) * self.primary.block_bytes, 0.0)
        return rows

    def complete_load(self, keys: Iterable[BlockKey], request: RequestContext | None = None) -> None:
        """The device copied ``keys`` out: release the pins the request's :meth:`prepare_load` took. A
        key with no load of that request outstanding is ignored and counted (the CPU tier's
        ``stray_load_completion`` failures), never taking away a pin a cascade or another request holds."""
        self.primary.complete_load(self._open_keys("complete_load", keys, request), request and request.req_id)

    def touch(self, keys: Sequence[BlockKey], request: RequestContext | None = None) -> None:
        """Recency for ``keys`` in every tier the request may load from (also for blocks hit in the
        device cache)."""
        keys = self._open_keys("touch", keys, request)
        self.primary.touch(keys)
        self._tiers.touch(keys, request, self.request_control)

    def prepare_store(
        self, keys: Sequence[BlockKey], request: RequestContext | None = None
    ) -> PrepareStoreResult | None:
        """Reserve CPU rows for a device -> CPU store; None if no room can be made."""
        keys = self._open_keys("prepare_store", keys, request)
        self._poll_once()
        if request is not None and not (request.control or self.request_control(request)).store:
            self._tiers.counters.stores_declined += len(keys)
            return PrepareStoreResult([], np.empty(0, dtype=np.int64), [])
        state = self._requests.state(request)
        result = self.primary.prepare_store(
            keys, self._hits.protected(), after=state.chain_tail if state else None,
            continues=state is not None and state.stored_tail,
        )  # fmt: skip
        if result is None:
            self._tiers.counters.store_rejections += 1
            return None
        if state is None:
            if result.keys_to_store and result.keys_to_store[-1] == keys[-1]:  # a whole request, its tail new
                self.primary.end_request(keys[-1])
            return result
        state.note_store(keys, result.keys_to_store)
        if state.request_level_tiers:
            new = set(result.keys_to_store)
            self._requests.cascade(state, [k for k in dict.fromkeys(keys) if k not in new])
        return result

    def complete_store(
        self, keys: Sequence[BlockKey], request: RequestContext | None = None, success: bool = True
    ) -> None:
        """The device -> CPU copy of ``keys`` finished; on success cascade them to every tier.

        Only rows that :meth:`prepare_store` reserved and nothing completed since are
        acted on (never a row a promotion is writing). A copy started before
        :meth:`reset_cache` must not be reported: its key's next store is another write. The
        blocks are made readable and pinned for each tier they cascade to in one pass.
        """
        keys = self._open_keys("complete_store", keys, request, success)
        targets: list[TierHandle] = []
        if success:
            wanted = None if request is None else (request.control or self.request_control(request)).cascade_to
            targets = self._tiers.targets(self._tiers.live, wanted)
        done, slots = self.primary.complete_device_store(keys, success, len(targets))
        if self._waits.since or self._waits.abandoned:  # a lookup waited on one of these writes
            self._waits.stored(done, success)
        # A late completion (after reset, or after the request was finalized) must not
        # bring back a state that nothing would ever finish.
        state = self._requests.find(request)
        if state is not None:
            state.pending_store_keys.difference_update(done)
        if targets and done:
            admitted = self._tiers.admit(targets, done, request)
            for _ in range(len(targets) - len(admitted)):
                self.primary.unpin(done)  # pinned for a tier that did not admit them: released at once
            if admitted:
                self._jobs.submit_cascades(done, slots, admitted, request)
        if state is not None:
            self._requests.finalize_if_done(state)

    def on_new_request(self, request: RequestContext) -> OffloadPolicy:
        """REQUEST_LEVEL if any tier asks for it, else BLOCK_LEVEL."""
        if self._closing:
            raise ManagerClosedError.of("on_new_request")
        self.request_control(request)
        state = self._requests.state(request)
        assert state is not None
        state.request_level_tiers = self._tiers.request_level(request)
        return OffloadPolicy.REQUEST_LEVEL if state.request_level_tiers else OffloadPolicy.BLOCK_LEVEL

    def on_request_finished(self, request: RequestContext) -> None:
        """No more submit-side calls for ``request``; completions may still arrive."""
        if (wrong := build.bad_call("on_request_finished", (), request, True, needed=True)) or self._closing:
            raise wrong or ManagerClosedError.of("on_request_finished")
        state = self._requests.find(request)
        if state is None:
            if self._requests.first_finish(request):  # tiers hear a request finish once
                self._tiers.broadcast("on_request_finished", request)
            return
        state.finished = True
        if state.stored_tail and state.chain_tail is not None:  # the policy hears the hints too
            self.primary.end_request(state.chain_tail, (request.control or self.request_control(request)).hints)
        self._requests.finalize_if_done(state)

    def on_schedule_end(self) -> None:
        """Once per engine step: poll, submit this step's promotions, flush parked cascades.

        The requests with promotions (just submitted) or parked cascades are visited in
        the order they came: what can go is flushed, what is done is finalized.
        """
        if self._closing:
            raise ManagerClosedError.of("on_schedule_end")
        self._poll_once()
        self._jobs.submit_promotions()
        if self._requests.has_step_work:
            self._requests.end_step()
        self._tiers.end_step()
        self._hits.clear()
        self._steady = self._fast = False
        self.primary.step_ended()

    def has_pending_work(self) -> bool:
        """True while a tier job is in flight, a promotion awaits submission, or a cascade is parked."""
        if self._closing:
            raise ManagerClosedError.of("has_pending_work")
        return self._jobs.busy or self._requests.any_parked() or self._tiers.has_pending_work()

    def take_events(self) -> list[BlockEvent]:
        """Stored/removed events of the CPU tier (unless built with ``events=False``) and every
        secondary tier since the last call."""
        if self._closing:
            raise ManagerClosedError.of("take_events")
        events = self.primary.take_events()
        for handle, taken in self._tiers.broadcast("take_events"):
            answer: tuple[list[BlockEvent], str | None] = ([], None)
            good, problem = handle.guard("take_events", partial(checked_answers, taken, BlockEvent, "take_events()"),
                                         answer)  # fmt: skip
            if problem is not None:
                handle.failed("take_events", TypeError(problem))
            events += good
        return events

    @property
    def is_idle(self) -> bool:
        """No request is known, no tier job is in flight and no promotion awaits submission."""
        return not (self._jobs.busy or len(self._requests))

    def jobs_in_flight(self) -> int:
        if self._closing:
            raise ManagerClosedError.of("jobs_in_flight")
        return len(self._jobs)

    def reset_cache(self, drain_timeout: float | None = None) -> None:
        """Drain every tier, consume completions, drop unsubmitted promotions, reset the CPU tier.

        Blocks until in-flight tier copies finish (never aborts one halfway).
        Persistent tiers keep their data. Raises :class:`TierError` (and resets
        nothing) if a tier cannot drain within the timeout. The engine's own copies
        may still run: their rows stay out of use for ``primary.reset_hold_steps`` steps
        (or until ``primary.release_held()``); the engine drops their completions.
        """
        if self._closing:
            raise ManagerClosedError.of("reset_cache")
        build.check_shutdown_timeout(drain_timeout, "reset_cache(drain_timeout=...)")
        self._jobs.drain(self._tiers.live, self.drain_timeout if drain_timeout is None else drain_timeout)
        self._jobs.drop_promotions()
        for state in self._requests.reset():
            self._requests.finalize_if_done(state)
        self.primary.reset()
        self._waits.clear()
        self._tiers.forget_retries()
        self._hits.clear()
        self._steady = self._fast = False

    def request_control(self, request: RequestContext) -> RequestControl:
        """What ``request`` allows (:mod:`kvtier.request_control`), parsed from its params once
        and kept in ``request.control``. Malformed keys fall back to their defaults (a request
        is never refused for them), are counted per kind and logged at the 1st, 10th, 100th...
        occurrence; nothing of the value is kept (:class:`~kvtier.request_control.ControlProblemLog`)."""
        return self._requests.control(request)

    def tier_descriptors(self) -> list[TierDescriptor]:
        """Index, label, type and locality of every tier, the CPU tier first (what request
        selectors match)."""
        return list(self._requests.descriptors)

    @property
    def telemetry(self) -> list[TierTelemetry]:
        """The manager's per-tier accumulators (index 0: CPU tier). Scheduler thread only; read
        :meth:`stats` instead unless you need raw samples (see ``LatencyHistogram.keep_samples``)."""
        return list(self._tiers.telemetry)

    def stats(self) -> ManagerSnapshot:
        """A typed snapshot of the manager and every tier (:class:`~kvtier.telemetry.ManagerSnapshot`).

        Never raises because a tier misbehaves: a tier whose ``stats``,
        ``usage()`` or ``health()`` raises gets safe defaults (unknown usage,
        health ``unknown``), and the failure is counted (``call_error``) and logged
        once. May be called after shutdown. Cost: a few microseconds per tier plus
        each tier's ``usage()``/``health()``.
        """
        return snapshot.manager_snapshot(self.primary, self._tiers, self._tally, self._hits.count(), len(self._jobs),
                                         len(self._requests), self._requests.control_problems())

    def shutdown(self, timeout: float | None = None) -> None:
        """Shut down every secondary tier, then (only if all succeeded) the CPU tier.

        Every tier is attempted even after earlier ones fail; each failure is logged with the tier's
        index, type and class. If any failed, the CPU tier and its shared mapping are left intact (a
        failed tier may still be using the rows) and :class:`TierShutdownError` is raised, carrying
        every failure and chained to the last one. Calling again retries only the failed tiers,
        then releases the CPU tier. After a complete shutdown this is a no-op; a call from another thread
        waits for one running; one nested in it (a signal handler) returns at once (the running one raises).
        KeyboardInterrupt and SystemExit propagate at once and never lead to the CPU tier being released.
        A view of :attr:`rows` still held by the caller makes the release raise
        :class:`~kvtier.errors.RegionBusyError` (the tiers are shut down; drop the view and call again).

        Deadline: ``timeout`` seconds (default: ``shutdown_timeout`` of the constructor; None there
        means no deadline) for all tiers together. Each tier's ``shutdown()`` then runs on its own
        thread and is waited for at most its share (the time left divided by the tiers left); a tier that
        overruns is abandoned and fails with :class:`TierShutdownTimeout`, and the
        next tiers are still attempted. A retry waits again for a tier still
        running its earlier ``shutdown()`` instead of calling it twice.
        """
        build.check_shutdown_timeout(timeout, "shutdown(timeout=...)", positive=True,
                                     none_means="the shutdown_timeout setting")  # (0: every tier abandoned)
        if self._tiers.shutdown_call.nested():  # inside the running call, on its thread (a signal handler)
            return
        with self._tiers.shutdown_call.lock:  # another thread's call waits for the running one
            if self.primary.is_shut_down:
                return
            self._closing = True
            self._steady = self._fast = self._hits.timed = False
            failures = self._tiers.shutdown(self.shutdown_timeout if timeout is None else timeout)
            if failures:
                raise TierShutdownError(failures) from failures[-1].error
            self._jobs.clear(self._tiers.handles)
            self.primary.shutdown()

    @property
    def is_shut_down(self) -> bool:
        return self.primary.is_shut_down

    def __enter__(self) -> TieringManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


__all__ = ["LOOKUP_TIMING_EVERY", "TieringManager"]
