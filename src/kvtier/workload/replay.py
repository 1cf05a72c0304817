"""Replay a block trace through the real :class:`~kvtier.manager.TieringManager`.

Metadata-only mode: the manager, the CPU tier and its eviction policy run for
real, but no KV bytes move (the region is tiny and never pre-faulted: rows of
one page each, and nothing writes them). Each request does what an engine's
scheduler does:

1. ``lookup`` its keys in order until the first non-HIT (a prefix hit; with
   secondary tiers, HIT_PENDING promotions are waited for, step by step);
2. ``prepare_load`` / ``complete_load`` the hit prefix (recency);
3. ``prepare_store`` / ``complete_store`` the rest (evicting as needed), in
   the pieces an engine stores (see :func:`store_pieces`): in one store,
   ``store_chunk`` blocks at a time (a prefill in chunks, or decoded blocks one
   by one), or ``"mixed"``: a prefill in chunks of
   :data:`MIXED_PREFILL_CHUNK` blocks, then decode stores of one block;
4. ``on_request_finished``, ``on_schedule_end``.

Blocks evicted by a later store of their own request (self-evictions: the
request's earlier pieces, lost before it even finished) are counted in the
result's ``extra["self_evictions"]``.

With secondary tiers configured, their cascades and promotions are real (they
read and write the small rows), so per-tier hit rates are measured end to end.
Each request's cascades are waited for before the next request starts (a real
engine's compute time), so a tier never sheds writes because the replay
outruns it; this is slow (one small file per distinct block for fs), so use
``--limit`` with tiers.

Called from one thread (the caller's), which plays the scheduler.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeAlias

from kvtier.errors import KvtierError
from kvtier.interrupts import interrupts_deferred
from kvtier.keys import BlockKey, KVGeometry, Namespace, chain_ids
from kvtier.manager import TieringManager
from kvtier.policies import DEFAULT_POLICY
from kvtier.types import LookupResult, RequestContext
from kvtier.workload.simulate import HitRateResult
from kvtier.workload.trace import TRACE_BLOCK_TOKENS, FlatTrace, TraceRequest

logger = logging.getLogger(__name__)

REPLAY_BLOCK_BYTES = 64
"""Payload bytes per block in metadata-only replay (a row still takes one page)."""

MIXED = "mixed"
"""The ``store_chunk`` of the mixed mode: a prefill in chunks, then decode stores of one block."""

MIXED_PREFILL_CHUNK = 16
"""Blocks per prefill store in the mixed mode."""

StoreChunk: TypeAlias = int | Literal["mixed"] | None
"""How a request's missed blocks are stored: None (one store), N blocks a store, or ``"mixed"``."""


def decode_blocks(requests: Sequence[TraceRequest], block_tokens: int = TRACE_BLOCK_TOKENS) -> list[int]:
    """Blocks each request's output fills (``ceil(output_length / block_tokens)``, at least 1; a
    Mooncake trace's blocks hold 512 tokens): its decode stores in the mixed mode (see
    :func:`store_pieces`)."""
    return [max(1, -(-r.output_length // block_tokens)) for r in requests]


def store_mode(store_chunk: StoreChunk) -> str:
    """How requests are stored, as the replay's header says it ("" for one store per request)."""
    if store_chunk is None:
        return ""
    if store_chunk == MIXED:
        return f"; {MIXED_PREFILL_CHUNK}-block prefill stores, then a store per decoded block (--store-chunk mixed)"
    return f"; stores of at most {store_chunk} blocks (--store-chunk)"


def store_pieces(missed: int, store_chunk: StoreChunk, decode: int = 1) -> list[int]:
    """The sizes of the stores an engine makes of a request's ``missed`` blocks, in order.

    ``store_chunk`` None: one store; N: N blocks a store (the last may be
    smaller); ``"mixed"``: the blocks but the last ``decode`` (at least 1, at
    most ``missed``) in prefill stores of :data:`MIXED_PREFILL_CHUNK`, then the
    last ``decode`` one block a store, as the decode phase stores each block it
    fills. Raises ValueError for any other ``store_chunk``.
    """
    if store_chunk is None:
        return [missed] if missed else []
    if store_chunk == MIXED:
        tail = min(missed, max(1, decode))
        head = missed - tail
        return [min(MIXED_PREFILL_CHUNK, head - i) for i in range(0, head, MIXED_PREFILL_CHUNK)] + [1] * tail
    if isinstance(store_chunk, bool) or not isinstance(store_chunk, int) or store_chunk < 1:
        raise ValueError(f"store_chunk must be a positive number of blocks or {MIXED!r}, got {store_chunk!r}")
    return [min(store_chunk, missed - i) for i in range(0, missed, store_chunk)]


def replay_namespace(block_bytes: int = REPLAY_BLOCK_BYTES, key_seed: int = 0) -> Namespace:
    """The namespace replays run under (a synthetic uint8 geometry of ``block_bytes``).

    ``key_seed`` names another namespace, so every block gets other key bytes: the same trace,
    the same reuse, another draw of the keys a sampling policy follows (``return-time`` samples
    keys by their bytes; LRU's decisions do not depend on them). 0 is the default namespace.
    """
    model = "kvtier/trace-replay" if not key_seed else f"kvtier/trace-replay/key-seed-{key_seed}"
    return Namespace(model, KVGeometry.from_block_bytes(block_bytes, tokens_per_block=16))


def trace_keys(trace: FlatTrace, namespace: Namespace) -> list[list[BlockKey]]:
    """Block keys per request: each request's ``hash_ids`` chained under ``namespace``."""
    starts = trace.starts.tolist()
    ids = trace.ids.tolist()
    return [chain_ids(ids[starts[i] : starts[i + 1]], namespace) for i in range(len(starts) - 1)]


def _tier_of(manager: TieringManager, before: Sequence[int]) -> int:
    for pos, tier in enumerate(manager.tiers):
        if tier.stats.lookups_hit > before[pos]:
            return pos + 1
    return 0


def replay_manager(
    keys: Sequence[Sequence[BlockKey]],
    capacity: int,
    *,
    policy: str = DEFAULT_POLICY,
    namespace: Namespace | None = None,
    tiers: Sequence[dict[str, Any]] = (),
    shm_dir: str = "/dev/shm",
    pending_timeout: float = 30.0,
    progress: Callable[[int], None] | None = None,
    store_chunk: StoreChunk = None,
    decode_blocks: Sequence[int] | None = None,
    params: Sequence[Mapping[str, Any] | None] | None = None,
) -> HitRateResult:
    """Replay requests (lists of block keys) through a real manager with ``capacity`` CPU blocks.

    Returns prefix hits split by tier (``"cpu"`` and each secondary tier's label),
    with ``extra["self_evictions"]``: blocks evicted by a later store of their own
    request, and per secondary tier ``extra["written_bytes:LABEL"]`` (bytes its cascades
    wrote), ``"admitted_blocks:LABEL"`` and ``"declined_blocks:LABEL"`` (its admission's
    count) and, with ``admission: learned``, its guard's ``"overridden_blocks:LABEL"``,
    ``"guard_fallbacks:LABEL"``, ``"guard_fallen_back:LABEL"`` (1 at the end of the run) and
    ``"hits_gained:LABEL"`` / ``"hits_lost:LABEL"`` (its estimates against writing everything).
    ``store_chunk``: how each request's missed blocks are stored (one
    ``prepare_store`` / ``complete_store`` per piece, see :func:`store_pieces`);
    ``decode_blocks[i]``: request ``i``'s decode stores in the mixed mode (default 1).
    ``params[i]``: request ``i``'s per-request params (its ``kv_transfer_params``: the
    application hints of :func:`~kvtier.workload.synthetic.generate_with_hints`; None: none).
    ``progress`` is called with the number of requests done, every 256 requests and at the end.
    Raises :class:`KvtierError` if a promotion stays pending beyond ``pending_timeout``,
    ValueError for a bad ``store_chunk``.
    Long because set-up, the replay loop and the per-tier accounting share the manager's lifetime.
    """
    store_pieces(1, store_chunk)  # checks it before anything starts
    ns = namespace or replay_namespace()
    start = time.perf_counter()
    manager: TieringManager | None = None
    try:
        with interrupts_deferred():  # (an interrupt never lands between the build and the assignment)
            manager = TieringManager.create(
                namespace=ns,
                num_cpu_blocks=capacity,
                policy=policy,
                tiers=[dict(t) for t in tiers],
                shm_dir=shm_dir,
                prefault=False,
                region_name=f"replay-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            )
        labels = ["cpu"] + [manager.tier_label(i + 1) for i in range(len(manager.tiers))]
        tier_hits = dict.fromkeys(labels, 0)
        refs = 0
        rejected = 0
        self_evicted = 0
        lookup_seconds = 0.0
        lookups = 0
        lookup = manager.lookup
        hit = LookupResult.HIT
        for n, request_keys in enumerate(keys):
            given = params[n] if params is not None else None
            req = RequestContext(f"r{n}", dict(given)) if given else RequestContext(f"r{n}")
            manager.on_new_request(req)
            refs += len(request_keys)
            hits = 0
            t0 = time.perf_counter()
            for key in request_keys:
                if not manager.tiers:
                    if lookup(key, req) is not hit:
                        break
                    tier_hits["cpu"] += 1
                else:
                    found = _lookup_waiting(manager, key, req, pending_timeout)
                    if found is None:
                        break
                    # Pin at once: waiting for the next promotion steps the manager,
                    # and a promotion's reservation may evict unpinned blocks.
                    manager.prepare_load([key], req)
                    tier_hits[labels[found]] += 1
                hits += 1
            lookup_seconds += time.perf_counter() - t0
            lookups += min(hits + 1, len(request_keys))
            if hits:
                prefix = list(request_keys[:hits])
                if not manager.tiers:
                    manager.prepare_load(prefix, req)
                manager.complete_load(prefix, req)
            rest = request_keys[hits:]
            decode = decode_blocks[n] if decode_blocks is not None else 1
            stored: set[BlockKey] = set()
            first = 0
            for size in store_pieces(len(rest), store_chunk, decode):
                result = manager.prepare_store(rest[first : first + size], req)
                first += size
                if result is None:
                    rejected += 1
                    continue
                if stored and result.evicted_keys:
                    self_evicted += sum(1 for k in result.evicted_keys if k in stored)
                if result.keys_to_store:
                    stored.update(result.keys_to_store)
                    manager.complete_store(result.keys_to_store, req, True)
            manager.on_request_finished(req)
            manager.on_schedule_end()
            if manager.tiers:
                # Lossless replay: let every cascade land before the next request (a
                # real engine's compute time), so tiers never shed writes here.
                _settle(manager, pending_timeout)
            if progress is not None and (n + 1) % 256 == 0:
                progress(n + 1)
        if progress is not None:
            progress(len(keys))
        _settle(manager, pending_timeout)
        stats = manager.stats()
    finally:
        if manager is not None:
            with interrupts_deferred():
                manager.shutdown()
    hits_total = sum(tier_hits.values())
    policy_values = stats.cpu.policy.values if stats.cpu.policy is not None else {}
    written: dict[str, float] = {}
    for tier in stats.tiers[1:]:  # what each secondary tier was given (its admission's work)
        written[f"written_bytes:{tier.label}"] = tier.written.bytes
        if tier.admission is not None:
            written[f"admitted_blocks:{tier.label}"] = tier.admission.admitted_blocks
            written[f"declined_blocks:{tier.label}"] = tier.admission.declined_blocks
            if tier.admission.guard is not None:  # the learned rule's measured guard
                written[f"overridden_blocks:{tier.label}"] = tier.admission.overridden_blocks
                written[f"guard_fallbacks:{tier.label}"] = tier.admission.guard_fallbacks
                written[f"guard_fallen_back:{tier.label}"] = float(tier.admission.guard == "fallen_back")
                written[f"hits_gained:{tier.label}"] = tier.admission.hits_gained
                written[f"hits_lost:{tier.label}"] = tier.admission.hits_lost
    extra: dict[str, float] = {
        **{f"policy_{name}": value for name, value in policy_values.items()},
        **written,
        "store_rejections": rejected,
        "self_evictions": self_evicted,
        "evictions": stats.cpu.evictions,
        "lookup_us_mean": 1e6 * lookup_seconds / lookups if lookups else 0.0,
    }
    return HitRateResult(f"kvtier-{policy}", capacity, refs, hits_total, time.perf_counter() - start, tier_hits, extra)


def compare_policies(
    keys: Sequence[Sequence[BlockKey]],
    capacities: Sequence[int],
    policies: Sequence[str],
    *,
    namespace: Namespace | None = None,
    tiers: Callable[[str, int], Sequence[dict[str, Any]]] | None = None,
    shm_dir: str = "/dev/shm",
    announce: Callable[[str, int], None] | None = None,
    store_chunk: StoreChunk = None,
    decode_blocks: Sequence[int] | None = None,
    progress: Callable[[int], None] | None = None,
    params: Sequence[Mapping[str, Any] | None] | None = None,
) -> dict[int, dict[str, HitRateResult]]:
    """Replay ``keys`` through a manager per (capacity, policy); ``"lru"`` always runs, as the baseline.

    Each result's ``extra["ratio_to_lru"]`` is its hit rate over LRU's at the
    same capacity (1.0 where both are 0, infinite where only LRU's is). ``tiers(policy, capacity)`` gives
    each run its own secondary tiers (a persistent tier must not be shared
    between runs, or a later run starts warm). ``announce(policy, capacity)``
    is called before each run; ``store_chunk``, ``decode_blocks``, ``params`` and ``progress``
    (requests done in the current run) as in :func:`replay_manager`.
    """
    names = list(dict.fromkeys([*policies, "lru"]))
    out: dict[int, dict[str, HitRateResult]] = {}
    for capacity in capacities:
        runs: dict[str, HitRateResult] = {}
        for name in names:
            if announce is not None:
                announce(name, capacity)
            runs[name] = replay_manager(
                keys, capacity, policy=name, namespace=namespace, shm_dir=shm_dir,
                tiers=tiers(name, capacity) if tiers is not None else (), store_chunk=store_chunk,
                decode_blocks=decode_blocks, progress=progress, params=params,
            )  # fmt: skip
        lru = runs["lru"].hit_rate
        for result in runs.values():
            # (infinite where LRU hit nothing and the policy something: None in the JSON rows)
            result.extra["ratio_to_lru"] = result.hit_rate / lru if lru else 1.0 if not result.hit_rate else math.inf
        out[capacity] = runs
    return out


def _settle(manager: TieringManager, timeout: float) -> None:
    """Step the manager until no tier job is in flight (bounded by ``timeout``)."""
    deadline = time.monotonic() + timeout
    while manager.has_pending_work():
        if time.monotonic() > deadline:
            raise KvtierError(f"tier jobs still pending after {timeout}s; is a tier stuck?")
        time.sleep(0.0001)
        manager.on_schedule_end()


def _lookup_waiting(manager: TieringManager, key: BlockKey, req: RequestContext, timeout: float) -> int | None:
    """Tier index (0 = CPU) that served ``key``, stepping the manager while it is pending."""
    before = [t.stats.lookups_hit for t in manager.tiers]
    source: int | None = None
    deadline = time.monotonic() + timeout
    while True:
        answer = manager.lookup(key, req)
        if answer is LookupResult.HIT:
            return source if source is not None else _tier_of(manager, before)
        if answer is LookupResult.MISS:
            return None
        if source is None and answer is LookupResult.HIT_PENDING:
            source = _tier_of(manager, before)
        if time.monotonic() > deadline:
            raise KvtierError(f"block stayed {answer.value} for {timeout}s during replay; is a tier stuck?")
        manager.on_schedule_end()
        time.sleep(0.0002)
