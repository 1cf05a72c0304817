"""Scheduler-side cost of TieringManager, against a plain dict lookup in the same run.

Measures the bookkeeping the engine's scheduler thread pays per block (no bytes
move: the secondary tiers are in-memory doubles that answer at once and copy
nothing, and the rows of the shared region are never touched):

* lookup HIT on a CPU tier of ``--blocks`` ready blocks;
* lookup MISS with 2 secondary tiers that answer MISS;
* prepare_store + complete_store of ``--batch`` new blocks into a full CPU tier
  (every block evicts one), without and with cascades to 2 secondary tiers, one
  engine step per batch;
* decode: the same, one block per store: requests store ``--batch`` blocks, then
  ``--batch`` more one at a time, each store continuing the request's last (an
  engine's decode phase), 64 requests per step; the one-block stores are timed;
* a promotion round trip: lookup -> HIT_PENDING -> on_schedule_end -> the tier
  completes -> next step's lookup -> HIT, in batches of ``--batch`` blocks;
* metadata bytes per block of the CPU tier (index, ref counts, policy, and the
  key objects the index and ARC's ghost lists keep alive) at ``--meta-blocks``
  blocks, by tracemalloc: right after filling an empty tier, in the steady state
  of a running engine (after as many evictions again: hash tables grown by
  deletions), and in a steady state with reuse (3 in 4 blocks used a second time,
  then as many evictions again: ARC's T2 holds most blocks and its ghost lists
  B1 + B2 are full, ARC's worst case), with the allocation sites that cost the
  most in that last state.

The baseline is ``dict.get`` over the same keys in the same (random) order, in
the same loop shape, interleaved with the lookup runs; with ``--policy`` other
than lru, lru is measured too, interleaved run by run, for the policy's ratios.
Times are CPU time of the calling thread (all the bookkeeping happens there),
so load from other processes does not count. Each figure is the best of
``--repeat`` runs; the machine is shared and noisy, so read the ratios. Targets: lookup HIT within
20x the dict baseline; metadata at most 256 bytes per block.

    .venv/bin/python benchmarks/bench_manager.py                 # < 1 min
    .venv/bin/python benchmarks/bench_manager.py --policy arc --repeat 7
"""

from __future__ import annotations

import argparse
import gc
import linecache
import multiprocessing
import os
import random
import sys
import time
import tracemalloc
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, ClassVar

import numpy as np

from common import make_keys
from kvtier import KVGeometry, LookupResult, Namespace, RequestContext, TieringManager
from kvtier.keys import BlockKey
from kvtier.policies import DEFAULT_POLICY, ARCPolicy
from kvtier.primary import PrimaryTier
from kvtier.region import SharedRegion, format_bytes
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TierUsage, TransferJob
from kvtier.tiers.registry import register_tier

BLOCK_BYTES = 4096
NAMESPACE = Namespace("bench-manager", KVGeometry.from_block_bytes(BLOCK_BYTES))
HIT_TARGET_RATIO = 20.0
LRU_TARGET_RATIO = 1.5
META_TARGET_BYTES = 256.0


class MemoryDouble(SecondaryTier):
    """A secondary tier that answers from a set and finishes every job at the next poll.

    It copies no bytes: the benchmark measures the scheduler-side bookkeeping only.
    """

    tier_type: ClassVar[str] = "bench-double"
    medium: ClassVar[str] = "memory"

    def __init__(self, context: TierContext) -> None:
        super().__init__(context)
        self.held: set[BlockKey] = set()
        self.jobs: list[int] = []

    def lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        return LookupResult.HIT if key in self.held else LookupResult.MISS

    def submit_store(self, job: TransferJob) -> None:
        self.jobs.append(job.job_id)

    def submit_load(self, job: TransferJob) -> None:
        self.jobs.append(job.job_id)

    def poll_finished(self) -> list[JobResult]:
        if not self.jobs:
            return []
        done = [JobResult(job_id, True) for job_id in self.jobs]
        self.jobs.clear()
        return done

    def has_pending_work(self) -> bool:
        return bool(self.jobs)

    def usage(self) -> TierUsage:
        return TierUsage(0, None, len(self.held))

    def drain(self, timeout: float | None = None) -> None:
        pass

    def shutdown(self) -> None:
        self.jobs.clear()


register_tier("bench-double", f"{__name__}:MemoryDouble")


def fill(mgr: TieringManager, keys: Sequence[BlockKey], batch: int = 256) -> None:
    """Make ``keys`` ready blocks of the CPU tier (bookkeeping only; rows untouched)."""
    for start in range(0, len(keys), batch):
        chunk = keys[start : start + batch]
        result = mgr.prepare_store(chunk)
        if result is None:
            raise SystemExit("fill: prepare_store refused")
        mgr.complete_store(result.keys_to_store)
        mgr.on_schedule_end()
    mgr.take_events()


def new_manager(blocks: int, policy: str, tiers: int, shm_dir: str) -> TieringManager:
    return TieringManager.create(
        namespace=NAMESPACE, num_cpu_blocks=blocks, policy=policy, tiers=[{"type": "bench-double"}] * tiers,
        shm_dir=shm_dir, prefault=False, sweep_stale=False,
    )


def doubles(mgr: TieringManager) -> list[MemoryDouble]:
    return [t for t in mgr.tiers if isinstance(t, MemoryDouble)]


# --- per-operation timings ------------------------------------------------------------------

_now_ns = time.thread_time_ns
"""CPU time of this thread: the scheduler-side work is all here, and other processes' load is not."""


def time_dict(table: dict[BlockKey, int], order: list[BlockKey]) -> float:
    get = table.get
    t0 = _now_ns()
    for k in order:
        get(k)
    return (_now_ns() - t0) / len(order)


def time_lookups(mgr: TieringManager, order: list[BlockKey], req: RequestContext, expect: LookupResult) -> float:
    mgr.on_schedule_end()
    lookup = mgr.lookup
    t0 = _now_ns()
    for k in order:
        lookup(k, req)
    ns = (_now_ns() - t0) / len(order)
    if lookup(order[0], req) is not expect:
        raise SystemExit(f"lookup answered {lookup(order[0], req)}, expected {expect}")
    return ns


def time_stores(mgr: TieringManager, fresh: list[BlockKey], batch: int) -> float:
    """prepare_store + complete_store of new blocks into a full tier, one step and one request per batch."""
    evicted = 0
    requests = [RequestContext(f"store-{i}") for i in range(0, len(fresh), batch)]
    gc.collect()
    t0 = _now_ns()
    for req, start in zip(requests, range(0, len(fresh), batch), strict=True):
        chunk = fresh[start : start + batch]
        result = mgr.prepare_store(chunk, req)
        if result is None:
            raise SystemExit("prepare_store refused although every block was evictable")
        evicted += len(result.evicted_keys)
        mgr.complete_store(result.keys_to_store, req)
        mgr.on_request_finished(req)
        mgr.on_schedule_end()
    ns = (_now_ns() - t0) / len(fresh)
    if evicted != len(fresh):
        raise SystemExit(f"expected {len(fresh)} evictions, got {evicted}")
    mgr.take_events()
    return ns


DECODE_REQUESTS = 64
"""Requests decoding at once in :func:`time_decode_stores` (each stores a block per step)."""


def time_decode_stores(mgr: TieringManager, fresh: list[BlockKey], batch: int, decode: bool = True) -> float:
    """ns per decoded block: requests store ``batch`` prefill blocks at once, then ``batch`` more one
    block per store, each continuing the request's last store (an engine's decode phase);
    :data:`DECODE_REQUESTS` requests per step, every block evicting one. Only the one-block
    stores and their steps are timed. ``decode=False``: the same requests and steps without the
    one-block stores (what ``bench_instructions.py`` subtracts); returns 0."""
    per = 2 * batch
    requests = [RequestContext(f"decode-{i}") for i in range(len(fresh) // per)]
    spent = evicted = decoded = 0
    gc.collect()
    for g in range(0, len(requests), DECODE_REQUESTS):
        group = list(enumerate(requests[g : g + DECODE_REQUESTS], start=g))
        for i, req in group:
            mgr.on_new_request(req)
            result = mgr.prepare_store(fresh[i * per : i * per + batch], req)
            if result is None:
                raise SystemExit("prepare_store refused although every block was evictable")
            mgr.complete_store(result.keys_to_store, req)
        mgr.on_schedule_end()
        t0 = _now_ns()
        for j in range(batch, per):
            for i, req in group if decode else ():
                result = mgr.prepare_store([fresh[i * per + j]], req)
                if result is None:
                    raise SystemExit("prepare_store refused although every block was evictable")
                evicted += len(result.evicted_keys)
                mgr.complete_store(result.keys_to_store, req)
            mgr.on_schedule_end()
        spent += _now_ns() - t0
        decoded += batch * len(group) if decode else 0
        for _, req in group:
            mgr.on_request_finished(req)
    if evicted != decoded:
        raise SystemExit(f"expected {decoded} evictions, got {evicted}")
    mgr.take_events()
    return spent / decoded if decoded else 0.0


def time_promotions(mgr: TieringManager, held: list[BlockKey], batch: int, req: RequestContext) -> float:
    """lookup -> HIT_PENDING -> step end -> tier completes -> lookup -> HIT, per block."""
    lookup, step_end = mgr.lookup, mgr.on_schedule_end
    pending, hit = LookupResult.HIT_PENDING, LookupResult.HIT
    bad = 0
    gc.collect()
    t0 = _now_ns()
    for start in range(0, len(held), batch):
        chunk = held[start : start + batch]
        for k in chunk:
            bad += lookup(k, req) is not pending
        step_end()
        for k in chunk:
            bad += lookup(k, req) is not hit
        step_end()
    ns = (_now_ns() - t0) / len(held)
    if bad:
        raise SystemExit(f"{bad} promotion lookups gave an unexpected answer")
    mgr.take_events()
    return ns


# --- metadata ---------------------------------------------------------------------------------


class _VirtualRegion:
    """Stands in for a SharedRegion when /dev/shm cannot hold even a sparse file of this size."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.row_stride = BLOCK_BYTES
        self.rows = np.empty((0, BLOCK_BYTES), dtype=np.uint8)
        self.name = "virtual"

    def close(self) -> None:
        pass


def metadata_bytes(blocks: int, policy: str, shm_dir: str) -> dict[str, Any]:
    """Traced bytes per block of a CPU tier of ``blocks`` blocks (run in a child process).

    ``full``: after storing ``blocks`` blocks into an empty tier. ``steady``: after
    storing ``blocks`` more (each evicting one), the state a running engine lives in:
    its hash tables have grown through deletions. No block is used twice, so ARC
    keeps every block in T1 and its ghost lists stay empty (|T1| + |B1| <= c).
    ``reuse``: then 3 in 4 of the resident blocks are used again (touched), and
    ``blocks`` more are stored, 3 in 4 of them touched right after: ARC's T1 drains,
    T2 holds most blocks and T2's evictions fill B2 until B1 + B2 hold ``blocks``
    ghost keys. Key objects are counted: once the engine forgets a block hash, the
    index (and the ghost lists) are what keeps it alive.
    """
    needed = (blocks + 1) * BLOCK_BYTES
    st = os.statvfs(shm_dir)
    region: Any
    if st.f_bavail * st.f_frsize >= needed:
        region = SharedRegion(f"bench-meta-{os.getpid()}", blocks, BLOCK_BYTES, shm_dir=shm_dir, prefault=False)
        where = f"{shm_dir} region of {format_bytes(needed)}, not prefaulted"
    else:
        region = _VirtualRegion(blocks)
        where = f"virtual region: {shm_dir} has less than {format_bytes(needed)} free"
    out: dict[str, Any] = {"region": where}
    try:
        gc.collect()
        tracemalloc.start()
        primary = PrimaryTier(region, BLOCK_BYTES, policy)
        for phase in ("full", "steady", "reuse"):
            reuse = phase == "reuse"
            if reuse:  # a second use of 3 in 4 resident blocks (equal keys, made again)
                resident = make_keys("meta-steady", blocks)
                primary.touch(k for i, k in enumerate(resident) if i % 4)
                del resident
            keys = make_keys(f"meta-{phase}", blocks)
            for start in range(0, blocks, 8192):
                chunk = keys[start : start + 8192]
                if primary.prepare_store(chunk) is None:
                    raise SystemExit("metadata: prepare_store refused")
                primary.complete_store(chunk)
                if reuse:
                    primary.touch(k for i, k in enumerate(chunk) if i % 4)
            primary.take_events()
            del keys, chunk
            gc.collect()
            out[phase] = tracemalloc.get_traced_memory()[0] / blocks
            policy = primary.policy
            if isinstance(policy, ARCPolicy):
                out[f"{phase}-lists"] = (f"T1 {policy.t1:,}, T2 {policy.t2:,}, "
                                         f"B1 {policy.b1:,}, B2 {policy.b2:,}")
        snapshot = tracemalloc.take_snapshot()
        tracemalloc.stop()
        sites = []
        for stat in snapshot.statistics("lineno")[:6]:
            frame = stat.traceback[0]
            filename = frame.filename.split("/src/")[-1] if "/src/" in frame.filename else os.path.basename(
                frame.filename)
            sites.append((f"{filename}:{frame.lineno}", stat.size / blocks, linecache.getline(
                frame.filename, frame.lineno).strip()))
        out["sites"] = sites
        del snapshot
        primary.shutdown()
    finally:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
        if isinstance(region, SharedRegion) and not region.closed:
            region.close()
    return out


# --- main -------------------------------------------------------------------------------------


def measure(policies: list[str], args: argparse.Namespace, keys: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Best-of-``repeat`` ns per operation and policy (see the module docstring).

    Every scenario builds one manager per policy and interleaves their runs, so
    load from the rest of the machine weighs on every policy alike.
    """
    n, batch, ops = args.blocks, args.batch, min(args.ops, args.blocks)
    req = RequestContext("bench")
    operations = ("dict", "hit", "miss", "store0", "store2", "decode0", "decode2", "promotion")
    out: dict[str, dict[str, float]] = {p: dict.fromkeys(operations, float("inf")) for p in policies}

    def managers(tiers: int) -> dict[str, TieringManager]:
        built = {p: new_manager(n, p, tiers=tiers, shm_dir=args.shm_dir) for p in policies}
        for mgr in built.values():
            fill(mgr, keys["resident"])
        return built

    def keep(policy: str, what: str, ns: float) -> None:
        out[policy][what] = min(out[policy][what], ns)

    built = managers(2)
    try:
        for _ in range(args.repeat):
            for p, mgr in built.items():
                gc.collect()
                keep(p, "dict", time_dict(keys["table"], keys["order"]))
                keep(p, "hit", time_lookups(mgr, keys["order"], req, LookupResult.HIT))
                keep(p, "miss", time_lookups(mgr, keys["absent"], req, LookupResult.MISS))
    finally:
        for mgr in built.values():
            mgr.shutdown()
    for tiers in (0, 2):
        built = managers(tiers)
        try:
            for r in range(args.repeat):
                for p, mgr in built.items():
                    keep(p, f"store{tiers}", time_stores(mgr, make_keys(f"store-{tiers}-{r}", ops), batch))
                    keep(p, f"decode{tiers}", time_decode_stores(mgr, make_keys(f"decode-{tiers}-{r}", ops), batch))
        finally:
            for mgr in built.values():
                mgr.shutdown()
    built = managers(1)
    try:
        held = [make_keys(f"held-{r}", ops) for r in range(args.repeat)]
        for mgr in built.values():
            for batch_keys in held:
                doubles(mgr)[0].held.update(batch_keys)
        for batch_keys in held:
            for p, mgr in built.items():
                keep(p, "promotion", time_promotions(mgr, batch_keys, batch, req))
    finally:
        for mgr in built.values():
            mgr.shutdown()
    return out


ROWS = [
    ("dict", "dict.get (baseline)"),
    ("hit", "lookup HIT"),
    ("miss", "lookup MISS, 2 secondary tiers"),
    ("store0", "prepare+complete_store, evicting, no secondary tiers (per block)"),
    ("store2", "prepare+complete_store, evicting, cascade to 2 tiers (per block)"),
    ("decode0", "decode: one-block stores continuing requests, evicting (per block)"),
    ("decode2", "decode, cascade to 2 tiers (per block)"),
    ("promotion", "promotion round trip, evicting (per block)"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=100_000, help="CPU tier size for the timings")
    parser.add_argument("--meta-blocks", type=int, default=1_000_000, help="CPU tier size for the metadata figure")
    parser.add_argument("--batch", type=int, default=16, help="blocks per store / promotion step")
    parser.add_argument("--ops", type=int, default=50_000, help="blocks per store / promotion measurement")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--policy", default=DEFAULT_POLICY,
                        help=f"eviction policy of the CPU tier, compared with lru in the same run "
                             f"(default {DEFAULT_POLICY})")
    parser.add_argument("--shm-dir", default="/dev/shm")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    compared = list(dict.fromkeys([args.policy, "lru"]))
    print(f"bench_manager: {args.blocks:,} CPU blocks of {BLOCK_BYTES} B, policy={args.policy}"
          f"{' (against lru)' if len(compared) > 1 else ''}, batch={args.batch}, best of {args.repeat}; "
          f"python {sys.version.split()[0]}")

    resident = make_keys("resident", args.blocks)
    order = resident[:]
    rng.shuffle(order)
    absent = make_keys("absent", args.blocks)
    rng.shuffle(absent)
    keys: dict[str, Any] = {"resident": resident, "order": order, "absent": absent,
                            "table": {k: i for i, k in enumerate(resident)}}
    results = measure(compared, args, keys)
    mine, lru = results[args.policy], results["lru"]
    dict_ns = min(r["dict"] for r in results.values())

    header = f"\n{'operation':64} {'ns':>7} {'x dict':>7}"
    if len(compared) > 1:
        header += f" {'lru ns':>7} {'x lru':>6}"
    print(header)
    verdicts: list[tuple[bool, str]] = []
    for key, label in ROWS:
        ns = dict_ns if key == "dict" else mine[key]
        line = f"{label:64} {ns:7.0f} {ns / dict_ns:7.1f}"
        if len(compared) > 1 and key != "dict":
            line += f" {lru[key]:7.0f} {ns / lru[key]:6.2f}"
        print(line)
    ratio = mine["hit"] / dict_ns
    met = ratio <= HIT_TARGET_RATIO
    verdicts.append((met, f"lookup HIT within {HIT_TARGET_RATIO:.0f}x dict.get: {'MET' if met else 'MISSED'} "
                          f"({ratio:.1f}x)"))
    if len(compared) > 1:
        for key, what in (("hit", "lookup HIT"), ("store0", "store with eviction"), ("store2", "store with cascades"),
                          ("decode0", "decode stores"), ("decode2", "decode stores with cascades")):
            ratio = mine[key] / lru[key]
            met = ratio <= LRU_TARGET_RATIO
            verdicts.append((met, f"{what} ({args.policy}) within {LRU_TARGET_RATIO}x of lru's: "
                                  f"{'MET' if met else 'MISSED'} ({ratio:.2f}x)"))

    print(f"\nmetadata per block at {args.meta_blocks:,} blocks (tracemalloc: index, ref counts, policy, "
          "key objects; one child process per policy)")
    policies = list(dict.fromkeys([*compared, "arc"]))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {p: pool.submit(metadata_bytes, args.meta_blocks, p, args.shm_dir) for p in policies}
        metas = {p: f.result() for p, f in futures.items()}
    print(f"  ({metas[policies[0]]['region']}; {time.perf_counter() - t0:.1f} s)")
    for policy, meta in metas.items():
        print(f"  {policy}: {meta['full']:.0f} B/block when full, {meta['steady']:.0f} B/block in steady state "
              f"(after {args.meta_blocks:,} evictions), {meta['reuse']:.0f} B/block in steady state with reuse "
              f"(3 in 4 blocks used twice, {args.meta_blocks:,} evictions more)")
        for phase in ("full", "steady", "reuse"):
            if f"{phase}-lists" in meta:
                print(f"      {phase}: {meta[f'{phase}-lists']}")
        print("    top allocation sites, steady state with reuse:")
        for site, per_block, code in meta["sites"]:
            if per_block >= 1:
                if site.startswith("bench_manager.py"):
                    code = "block key objects (made by the engine, kept alive by the tier)"
                print(f"      {per_block:6.1f} B  {site:28} {code[:70]}")
        met = max(meta["full"], meta["steady"]) <= META_TARGET_BYTES
        figures = f"{meta['full']:.0f} B full, {meta['steady']:.0f} B steady"
        verdicts.append((met, f"metadata ({policy}) at most {META_TARGET_BYTES:.0f} B/block, full and steady: "
                              f"{'MET' if met else 'MISSED'} ({figures})"))
        met = meta["reuse"] <= META_TARGET_BYTES
        verdicts.append((met, f"metadata ({policy}) at most {META_TARGET_BYTES:.0f} B/block, steady with reuse: "
                              f"{'MET' if met else 'MISSED'} ({meta['reuse']:.0f} B)"))

    print("\ntargets:")
    for _, verdict in verdicts:
        print(f"  {verdict}")
    return 0 if all(met for met, _ in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
