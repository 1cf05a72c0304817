"""Scheduler-side cost of kvtier's TieringManager against vLLM 0.32's own, same process, same run.

    .venv/bin/python benchmarks/bench_vs_vllm.py             # about a minute
    .venv/bin/python benchmarks/bench_vs_vllm.py --rounds 9

Both managers get the same setup: a CPU tier of ``--blocks`` (100,000) blocks
with LRU eviction, filled with ready blocks, and two in-memory secondary tiers
that keep a set of keys and finish every job at once (vLLM's own
``ExampleSecondaryTierManager``; for kvtier a tier with the same behaviour).
Batches of ``--batch`` (16) blocks, one engine step per batch. Per block:

* ``lookup HIT``: a block ready in the CPU tier;
* ``lookup MISS``: a block in no tier (both secondary tiers asked);
* ``store + cascade``: prepare_store of new blocks into the full CPU tier (each
  evicts one), complete_store, cascade to both secondary tiers, step end;
* ``promotion round trip``: a block only in a secondary tier: lookup (promotion
  starts), step end (the tier loads it), next step's lookup answers HIT;
* ``prefix scan HIT``: runs of ``--batch`` ready blocks scanned as an engine's
  prefix scan does: for vLLM one ``lookup`` per key (its connector's loop), for
  kvtier one ``lookup_prefix`` per run. The vLLM adapter cannot use
  ``lookup_prefix`` (vLLM 0.32's connector asks per key); an engine
  integration that owns its scan can.

No bytes move (the rows are never touched): this is the bookkeeping on the
engine's scheduler thread. Neither manager records KV events (vLLM's default:
its manager records them only when the engine publishes KV cache events, and
kvtier's vLLM adapter follows it); ``--events`` turns them on for both.

The floor, a third side run through the same loops in the same rounds: the same
work as bare dict/list operations, with no manager. Its CPU tier is an
``OrderedDict`` index (key -> row, oldest first: LRU eviction is ``popitem``)
and a list of row states; its secondary tiers are the same key dicts the
benchmark's tiers keep. Per row: a HIT is one index probe and one state read; a
MISS is a probe of the index and of each tier's dict; a store evicts (a
``popitem`` per block), indexes the new blocks, marks them written and pinned
for the two cascades, adds them to both tiers' dicts and releases the pins at
step end; a promotion probes the index and the tier, evicts one block, indexes
the new one as being written, and at step end checks it in the tier and marks
it ready, and the next lookup is a HIT; a prefix scan is one call per run
probing each key. Per-key rows make one call per key through the same lambda
as the managers (the engine's call shape).

Rounds alternate which side goes first. Each operation is timed in pieces of
about 256 blocks on the calling thread's CPU clock (all three sides do their
bookkeeping on it, so other processes' load does not count); the lookup rows
(HIT, MISS, prefix scan) end an engine step after each piece, untimed, and take
the mean of each 8 consecutive pieces (kvtier times every lookup of one step
with lookups in 8, ``LOOKUP_TIMING_EVERY``: each group holds one such step, so
the figure carries that cost; a single step of all the keys would hide it). The
figure is the median ns per block over every piece (or group) of every round. A row is MET when
kvtier is at least 8x faster than vLLM, or, where CPython cannot get there,
within 1.25x of the floor. Without vLLM installed the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import numpy as np

from common import make_keys
from kvtier import KVGeometry, LookupResult, Namespace, RequestContext, TieringManager
from kvtier.keys import BlockKey
from kvtier.manager.core import LOOKUP_TIMING_EVERY
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TierUsage, TransferJob
from kvtier.tiers.registry import register_tier

TARGET = 8.0
FLOOR_TARGET = 1.25
BLOCK_BYTES = 4096


class InMemoryTier(SecondaryTier):
    """kvtier's counterpart of vLLM's ExampleSecondaryTierManager: a key set, every job done at the next poll."""

    tier_type: ClassVar[str] = "bench-vs-vllm-memory"
    medium: ClassVar[str] = "memory"

    def __init__(self, context: TierContext) -> None:
        super().__init__(context)
        self.chunks: dict[BlockKey, bool] = {}
        self.completed: list[JobResult] = []

    def lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        return LookupResult.HIT if key in self.chunks else LookupResult.MISS

    def submit_store(self, job: TransferJob) -> None:
        for key in job.keys:
            self.chunks[key] = True
        self.completed.append(JobResult(job.job_id, True))

    def submit_load(self, job: TransferJob) -> None:
        ok = all(key in self.chunks for key in job.keys)
        self.completed.append(JobResult(job.job_id, ok))

    def poll_finished(self) -> list[JobResult]:
        done, self.completed = self.completed, []
        return done

    def has_pending_work(self) -> bool:
        return bool(self.completed)

    def usage(self) -> TierUsage:
        return TierUsage(0, None, len(self.chunks))

    def drain(self, timeout: float | None = None) -> None:
        pass

    def shutdown(self) -> None:
        self.completed = []


register_tier(InMemoryTier.tier_type, f"{__name__}:InMemoryTier")


class Side:
    """One manager behind a common surface: its manager, request, tiers and lookup answers.

    Subclasses set ``mgr``, ``req``, ``tiers`` (each with a ``chunks`` dict) and
    ``answers`` (the manager's HIT, HIT_PENDING and MISS), and say how a step ends.
    """

    name: str
    mgr: Any
    req: Any
    tiers: list[Any]
    answers: tuple[Any, Any, Any]

    def key(self, raw: bytes) -> bytes:
        return raw

    def step_end(self) -> None:
        raise NotImplementedError

    def lookup_fn(self) -> Callable[[bytes], Any]:
        lookup, req = self.mgr.lookup, self.req
        return lambda key: lookup(key, req)

    def prefix_scan_fn(self) -> Callable[[Sequence[bytes]], int]:
        """A prefix scan of a run of keys, the way vLLM's connector does it: one lookup per key
        until a MISS; returns the HITs. A side with a batched call overrides this."""
        lookup, req, hit = self.mgr.lookup, self.req, self.hit()

        def scan(keys: Sequence[bytes]) -> int:
            found = 0
            for key in keys:
                if lookup(key, req) is not hit:
                    break
                found += 1
            return found

        return scan

    def store_batch(self, keys: Sequence[bytes]) -> int:
        """prepare_store + complete_store (cascading) + step end; returns blocks evicted."""
        result = self.mgr.prepare_store(keys, self.req)
        if result is None:
            raise SystemExit(f"{self.name}: prepare_store refused although every block was evictable")
        self.mgr.complete_store(result.keys_to_store, self.req)
        self.step_end()
        return len(result.evicted_keys)

    def fill(self, keys: Sequence[bytes]) -> None:
        """Store ``keys`` into the empty CPU tier (nothing to evict yet)."""
        for start in range(0, len(keys), 4096):
            result = self.mgr.prepare_store(keys[start : start + 4096], self.req)
            if result is None:
                raise SystemExit(f"{self.name}: fill refused")
            self.mgr.complete_store(result.keys_to_store, self.req)
            self.step_end()
        self.drop_events()

    def seed_secondary(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            for tier in self.tiers:
                tier.chunks[key] = True

    def hit(self) -> Any:
        return self.answers[0]

    def pending(self) -> Any:
        return self.answers[1]

    def miss(self) -> Any:
        return self.answers[2]

    def drop_events(self) -> None:
        for _ in self.mgr.take_events():  # vLLM's is a generator: drained only when consumed
            pass

    def close(self) -> None:
        self.mgr.shutdown()


class KvtierSide(Side):
    name = "kvtier"

    def __init__(self, blocks: int, shm_dir: str, events: bool) -> None:
        ns = Namespace("bench-vs-vllm", KVGeometry.from_block_bytes(BLOCK_BYTES))
        self.mgr = TieringManager.create(
            namespace=ns,
            num_cpu_blocks=blocks,
            policy="lru",
            tiers=[{"type": InMemoryTier.tier_type}] * 2,
            shm_dir=shm_dir,
            prefault=False,
            sweep_stale=False,
            events=events,
        )
        self.req = RequestContext("bench")
        self.mgr.on_new_request(self.req)
        self.tiers = [t for t in self.mgr.tiers if isinstance(t, InMemoryTier)]
        self.answers = (LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS)

    def prefix_scan_fn(self) -> Callable[[Sequence[bytes]], int]:
        """kvtier's batched prefix scan: one lookup_prefix call per run."""
        lookup_prefix, req = self.mgr.lookup_prefix, self.req
        return lambda keys: lookup_prefix(keys, req).ready

    def step_end(self) -> None:
        self.mgr.on_schedule_end()


class VllmSide(Side):
    name = "vLLM"

    def __init__(self, blocks: int, events: bool) -> None:
        from vllm.v1.kv_offload.base import LookupResult as VllmLookup
        from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext, make_offload_key
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
        from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
        from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

        self._make_key = make_offload_key
        self._context = ScheduleEndContext((), ())
        # vLLM's region lives in /dev/shm under its engine id; the barrier (a no-op for one
        # process) makes the creator unlink the path right after mapping it.
        region = SharedOffloadRegion(
            f"kvtier-bench-vs-vllm-{os.getpid()}",
            blocks,
            None,
            BLOCK_BYTES,
            BLOCK_BYTES,
            barrier=lambda: None,
            populate_only_on_creator=True,
        )
        primary = CPUPrimaryTierOffloadingManager(blocks, region, cache_policy="lru", enable_events=events)
        view = primary.get_kv_memoryview()
        self.tiers = [ExampleSecondaryTierManager(None, view, "example") for _ in range(2)]  # type: ignore[arg-type]
        self.mgr = TieringOffloadingManager(primary, list(self.tiers))
        self.req = ReqContext("bench")
        self.mgr.on_new_request(self.req)
        self.answers = (VllmLookup.HIT, VllmLookup.HIT_PENDING, VllmLookup.MISS)

    def key(self, raw: bytes) -> bytes:
        return bytes(self._make_key(raw, 0))

    def step_end(self) -> None:
        self.mgr.on_schedule_end(self._context)


class FloorSide(Side):
    """The same work as bare dict/list operations, no manager (see the module docstring)."""

    name = "floor"

    def __init__(self, blocks: int) -> None:
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> row, oldest first
        self.state = [0] * blocks  # per row: -1 being written, 0 ready, > 0 pinned
        self.tiers = [{}, {}]
        self.promoting: list[tuple[dict[bytes, bool], bytes, int]] = []  # this step's loads
        self.cascading: list[int] = []  # rows pinned by this step's cascades (once per tier)
        self.req = None
        self.answers = ("HIT", "HIT_PENDING", "MISS")

    def fill(self, keys: Sequence[bytes]) -> None:
        self.index.update((key, row) for row, key in enumerate(keys))

    def seed_secondary(self, keys: Iterable[bytes]) -> None:
        for tier in self.tiers:
            tier.update(dict.fromkeys(keys, True))

    def lookup_fn(self) -> Callable[[bytes], Any]:
        index, state, tiers, promoting = self.index, self.state, self.tiers, self.promoting
        get, evict = index.get, index.popitem
        hit, pending, miss = self.answers

        def lookup(key: bytes, req: Any) -> str:
            row = get(key)
            if row is not None:
                return hit if state[row] >= 0 else pending
            for tier in tiers:
                if key in tier:
                    row = evict(last=False)[1]  # the oldest block (every one is ready here)
                    index[key] = row
                    state[row] = -1
                    promoting.append((tier, key, row))
                    return pending
            return miss

        req = self.req
        return lambda key: lookup(key, req)

    def prefix_scan_fn(self) -> Callable[[Sequence[bytes]], int]:
        get, state = self.index.get, self.state

        def scan(keys: Sequence[bytes]) -> int:
            found = 0
            for key in keys:
                row = get(key)
                if row is None or state[row] < 0:
                    break
                found += 1
            return found

        return scan

    def store_batch(self, keys: Sequence[bytes]) -> int:
        index, state, evict = self.index, self.state, self.index.popitem
        rows = []
        for key in keys:  # evict the oldest block, index the new one as being written
            row = evict(last=False)[1]
            index[key] = row
            state[row] = -1
            rows.append(row)
        for row in rows:  # written: ready and pinned once per tier it cascades to
            state[row] = len(self.tiers)
        for tier in self.tiers:
            for key in keys:
                tier[key] = True
            self.cascading += rows
        self.step_end()
        return len(keys)

    def step_end(self) -> None:
        state = self.state
        for tier, key, row in self.promoting:  # the tier loaded it: ready
            state[row] = 0 if key in tier else state[row]
        self.promoting.clear()
        for row in self.cascading:  # each tier stored it: its pin released
            state[row] -= 1
        self.cascading.clear()

    def drop_events(self) -> None:
        pass

    def close(self) -> None:
        pass


# --- the operations, ns per block of each piece -------------------------------------------

PIECE = 256
"""Blocks per timed piece (rounded to whole batches)."""

clock = time.thread_time_ns


def pieces(keys: Sequence[bytes], unit: int) -> list[Sequence[bytes]]:
    size = max(unit, PIECE // unit * unit)
    return [keys[start : start + size] for start in range(0, len(keys), size)]


def step_groups(samples: list[float]) -> list[float]:
    """The mean of each ``LOOKUP_TIMING_EVERY`` consecutive pieces (one engine step each): every
    group holds the one step whose lookups kvtier times (the last, partial group is dropped; fewer
    pieces than that make one group)."""
    n = LOOKUP_TIMING_EVERY
    groups = [statistics.fmean(samples[i : i + n]) for i in range(0, len(samples) - n + 1, n)]
    return groups or [statistics.fmean(samples)]


def time_lookups(side: Side, keys: Sequence[bytes], expect: Any) -> list[float]:
    """ns per block of per-key lookups, one engine step per piece (see :func:`step_groups`)."""
    lookup = side.lookup_fn()
    side.step_end()
    out = []
    gc.collect()
    for piece in pieces(keys, 1):
        t0 = clock()
        for k in piece:
            lookup(k)
        out.append((clock() - t0) / len(piece))
        side.step_end()
    out = step_groups(out)
    if lookup(keys[0]) is not expect:
        raise SystemExit(f"{side.name}: lookup answered {lookup(keys[0])}, expected {expect}")
    side.step_end()
    return out


def time_prefix_scans(side: Side, keys: Sequence[bytes], batch: int) -> list[float]:
    """ns per block of prefix scans of ``batch`` ready blocks each (every key answers HIT), one
    engine step per piece (see :func:`step_groups`)."""
    scan = side.prefix_scan_fn()
    side.step_end()
    out = []
    found = 0
    gc.collect()
    for piece in pieces(keys, batch):
        runs = [piece[start : start + batch] for start in range(0, len(piece), batch)]
        t0 = clock()
        for run in runs:
            found += scan(run)
        out.append((clock() - t0) / len(piece))
        side.step_end()
    out = step_groups(out)
    if found != len(keys):
        raise SystemExit(f"{side.name}: a prefix scan found {found} of {len(keys)} ready blocks")
    side.step_end()
    return out


def time_stores(side: Side, keys: Sequence[bytes], batch: int) -> list[float]:
    out = []
    evicted = 0
    gc.collect()
    for piece in pieces(keys, batch):
        batches = [piece[start : start + batch] for start in range(0, len(piece), batch)]
        t0 = clock()
        for chunk in batches:
            evicted += side.store_batch(chunk)
        out.append((clock() - t0) / len(piece))
    if evicted != len(keys):
        raise SystemExit(f"{side.name}: expected {len(keys)} evictions, got {evicted}")
    side.drop_events()
    return out


def time_promotions(side: Side, keys: Sequence[bytes], batch: int) -> list[float]:
    lookup = side.lookup_fn()
    pending, hit = side.pending(), side.hit()
    out = []
    bad = 0
    gc.collect()
    for piece in pieces(keys, batch):
        batches = [piece[start : start + batch] for start in range(0, len(piece), batch)]
        t0 = clock()
        for chunk in batches:
            for k in chunk:
                bad += lookup(k) is not pending
            side.step_end()
            for k in chunk:
                bad += lookup(k) is not hit
            side.step_end()
        out.append((clock() - t0) / len(piece))
    if bad:
        raise SystemExit(f"{side.name}: {bad} promotion lookups gave an unexpected answer")
    side.drop_events()
    return out


OPERATIONS = ("lookup HIT", "lookup MISS", "store + cascade", "promotion round trip", "prefix scan HIT")
SIDES = ("vLLM", "kvtier", "floor")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=100_000, help="CPU tier blocks (default 100,000)")
    parser.add_argument("--batch", type=int, default=16, help="blocks per batch / engine step (default 16)")
    parser.add_argument("--ops", type=int, default=16_384, help="blocks per operation and round (<= --blocks / 4)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument(
        "--events", action="store_true", help="both managers record KV events (default: neither, as vLLM runs)"
    )
    args = parser.parse_args()
    if args.ops * 4 > args.blocks:
        parser.error("--ops must be at most a quarter of --blocks (a round evicts 2 x --ops blocks)")
    try:
        import vllm
        from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager  # noqa: F401
    except ImportError as exc:
        print(f"bench_vs_vllm: vLLM is not importable here ({exc}); nothing to compare, skipping.")
        return 0
    logging.getLogger("vllm").setLevel(logging.WARNING)
    print(
        f"kvtier vs vLLM {vllm.__version__} TieringOffloadingManager and the floor (bare dict/list operations): "
        f"{args.blocks:,}-block LRU CPU tier, 2 in-memory secondary tiers, {args.batch}-block batches, "
        f"{args.ops:,} blocks per operation, {args.rounds} interleaved rounds, median ns per block of "
        f"{PIECE}-block pieces (thread CPU time), KV events {'on' if args.events else 'off'}"
    )
    rng = np.random.default_rng(0)
    results: dict[str, dict[str, list[float]]] = {op: {name: [] for name in SIDES} for op in OPERATIONS}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vs-vllm-", dir="/dev/shm") as shm:
        sides: list[Side] = []
        try:
            sides = [
                KvtierSide(args.blocks, shm, args.events),
                VllmSide(args.blocks, args.events),
                FloorSide(args.blocks),
            ]
            resident = make_keys("resident", args.blocks)
            for side in sides:
                side.fill([side.key(k) for k in resident])
            # The newest half of the inserted blocks: each round evicts 2 x --ops blocks, all older
            # than these, so they stay resident on every side (and are looked up in random order).
            inserted = list(resident)
            for r in range(args.rounds):
                newest = inserted[-(args.blocks // 2) :]
                hits = [newest[int(i)] for i in rng.integers(0, len(newest), args.ops)]
                misses = make_keys(f"miss/{r}", args.ops)
                stores = make_keys(f"store/{r}", args.ops)
                promotions = make_keys(f"promotion/{r}", args.ops)
                order = sides[r % len(sides) :] + sides[: r % len(sides)]
                for side in order if r % 2 == 0 else order[::-1]:
                    k = side.key
                    res = results
                    res["lookup HIT"][side.name] += time_lookups(side, [k(x) for x in hits], side.hit())
                    res["prefix scan HIT"][side.name] += time_prefix_scans(side, [k(x) for x in hits], args.batch)
                    res["lookup MISS"][side.name] += time_lookups(side, [k(x) for x in misses], side.miss())
                    res["store + cascade"][side.name] += time_stores(side, [k(x) for x in stores], args.batch)
                    mine = [k(x) for x in promotions]
                    side.seed_secondary(mine)
                    res["promotion round trip"][side.name] += time_promotions(side, mine, args.batch)
                inserted = inserted[-args.blocks :] + stores + promotions
        finally:
            for side in sides:
                side.close()
    print(
        f"\n{'operation':<24} {'vLLM ns':>9} {'kvtier ns':>10} {'floor ns':>9} {'vLLM/kvtier':>12} "
        f"{'kvtier/floor':>13} {'target':>7}"
    )
    met = 0
    for op in OPERATIONS:
        v, k, f = (statistics.median(results[op][name]) for name in SIDES)
        ok = v / k >= TARGET or k / f <= FLOOR_TARGET
        met += ok
        print(
            f"{op:<24} {v:>9,.0f} {k:>10,.0f} {f:>9,.0f} {v / k:>11.1f}x {k / f:>12.2f}x {'MET' if ok else 'MISSED':>7}"
        )
    print(
        f"\n{met} of {len(OPERATIONS)} operations MET the target: kvtier >= {TARGET:.0f}x faster than vLLM, "
        f"or within {FLOOR_TARGET}x of the floor"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
