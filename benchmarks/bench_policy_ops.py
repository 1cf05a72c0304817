"""Where a policy's store path spends its time: each policy call a CPU-tier store makes, per block.

``bench_manager.py`` times whole manager calls; this benchmark times the policy alone, call by call,
in the order the CPU tier makes them for a device store into a full tier:

* ``evict``: ``evict(n, ())``, the rows for the new blocks;
* ``insert``: ``insert_many`` of the new blocks;
* ``reference``: ``reference_chain`` (a request's first store) or ``continue_chain`` (a store
  continuing the request's last, as decode does);
* ``complete``: ``mark_evictable_many``, tail first (the copy finished);
* ``end``: ``end_request`` once the request finished.

Two shapes: 16-block stores, each a new request, and decode (requests store 16 blocks, then 16
more one block per store, each continuing the request). The tier is filled first with requests of
the same shape. Each call is timed with ``perf_counter_ns`` (a vDSO read, unlike a thread CPU
clock's system call, which costs more than a one-block call), less the clock's own cost measured
in the same run, with the garbage collector off; per operation the median over ``--repeat`` runs
interleaved across policies; the total is the sum of those medians, and its ratio to LRU's total
compares policies measured in the same run.

    .venv/bin/python benchmarks/bench_policy_ops.py                    # about 1 min
    .venv/bin/python benchmarks/bench_policy_ops.py --capacity 1000000 --ops 262144
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

from common import make_keys
from kvtier.keys import BlockKey
from kvtier.policies import create_policy
from kvtier.policies.base import EvictionPolicy

OPS = ("evict", "insert", "reference", "complete", "end")
PREFILL = 16
"""Blocks of a request's first store (every shape), and of its decode phase (one block a store)."""


def clock_cost(samples: int = 20_001) -> float:
    """ns between two back-to-back ``perf_counter_ns`` reads (median): subtracted from each timed call."""
    clock = time.perf_counter_ns
    gaps = []
    for _ in range(samples):
        t0 = clock()
        gaps.append(clock() - t0)
    return float(statistics.median(gaps))


class PolicyDriver:
    """Drives one policy as a full CPU tier would: its slot map and the per-call clocks."""

    def __init__(self, policy: EvictionPolicy, capacity: int, overhead: float) -> None:
        self.policy = policy
        self.slot_of: dict[BlockKey, int] = {}
        self.free = list(range(capacity - 1, -1, -1))
        self.overhead = overhead
        self.spent = dict.fromkeys(OPS, 0.0)
        self.blocks = 0

    def store(self, keys: list[BlockKey], parent: int, continues: bool, timed: bool) -> int:
        """Store ``keys`` after the block in slot ``parent`` (-1: none); returns the tail's slot."""
        clock = time.perf_counter_ns
        policy, slot_of, free, n = self.policy, self.slot_of, self.free, len(keys)
        shortfall = n - len(free)  # the CPU tier evicts what its free rows do not cover
        t0 = clock()
        chosen = policy.evict(shortfall, ()) if shortfall > 0 else []
        t1 = clock()
        if chosen is None:
            raise SystemExit(f"{policy.name}: evict({n}) refused on a tier of evictable blocks")
        free.extend(slot_of.pop(k) for k in chosen)
        slots = [free.pop() for _ in keys]
        slot_of.update(zip(keys, slots, strict=True))
        t2 = clock()
        policy.insert_many(keys, slots)
        t3 = clock()
        if continues:
            policy.continue_chain(keys, slots, parent)
        else:
            policy.reference_chain(keys, slots, parent, False)
        t4 = clock()
        policy.mark_evictable_many(keys[::-1], slots[::-1])
        t5 = clock()
        if timed:
            spent, over = self.spent, self.overhead
            spent["evict"] += t1 - t0 - over
            spent["insert"] += t3 - t2 - over
            spent["reference"] += t4 - t3 - over
            spent["complete"] += t5 - t4 - over
            self.blocks += n
        return slots[-1]

    def end(self, tail: int, timed: bool) -> None:
        clock = time.perf_counter_ns
        t0 = clock()
        self.policy.end_request(tail)
        t1 = clock()
        if timed:
            self.spent["end"] += t1 - t0 - self.overhead


def run_whole(driver: PolicyDriver, keys: list[BlockKey], timed: bool) -> None:
    """Requests of 16 new blocks, one store each."""
    for start in range(0, len(keys) - PREFILL + 1, PREFILL):
        driver.end(driver.store(keys[start : start + PREFILL], -1, False, timed), timed)


def run_decode(driver: PolicyDriver, keys: list[BlockKey], timed: bool) -> None:
    """Requests of 16 blocks in one store, then 16 more one block a store: those are timed, and the
    request's end (counted over its decoded blocks)."""
    per = 2 * PREFILL
    for start in range(0, len(keys) - per + 1, per):
        tail = driver.store(keys[start : start + PREFILL], -1, False, False)
        for i in range(start + PREFILL, start + per):
            tail = driver.store([keys[i]], tail, True, timed)
        driver.end(tail, timed)


SHAPES: dict[str, Callable[[PolicyDriver, list[BlockKey], bool], None]] = {
    "16-block stores": run_whole,
    "decode (1-block stores)": run_decode,
}


def measure(policy_names: list[str], capacity: int, ops: int, repeat: int) -> dict[str, dict[str, dict[str, float]]]:
    """ns per block per operation: ``result[shape][policy][op]``, medians of ``repeat`` runs."""
    fill = make_keys("fill", capacity)
    overhead = clock_cost()
    out: dict[str, dict[str, dict[str, float]]] = {}
    for shape, drive in SHAPES.items():
        samples: dict[str, dict[str, list[float]]] = {p: {op: [] for op in OPS} for p in policy_names}
        for r in range(repeat):
            order = policy_names if r % 2 == 0 else policy_names[::-1]
            for name in order:
                driver = PolicyDriver(create_policy(name, capacity), capacity, overhead)
                drive(driver, fill, False)
                fresh = make_keys(f"{shape}-{r}", ops)
                gc.collect()
                gc.disable()  # a collection the driver's allocations trigger is no policy's cost
                try:
                    drive(driver, fresh, True)
                finally:
                    gc.enable()
                for op in OPS:
                    samples[name][op].append(driver.spent[op] / max(1, driver.blocks))
        out[shape] = {p: {op: statistics.median(v) for op, v in by_op.items()} for p, by_op in samples.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=100_000, help="blocks in the tier (default 100,000)")
    parser.add_argument("--ops", type=int, default=65_536, help="new blocks stored per timed run")
    parser.add_argument("--repeat", type=int, default=5, help="runs per policy and shape (median)")
    parser.add_argument("--policy", default="lru,return-time,arc", help="policies, comma-separated; lru first")
    args = parser.parse_args(argv)
    names = [p.strip() for p in args.policy.split(",") if p.strip()]
    if not names or names[0] != "lru":
        parser.error("--policy must start with lru (the baseline of the ratios)")
    if args.capacity < 2 * PREFILL or args.ops < 2 * PREFILL or args.repeat < 1:
        parser.error(f"--capacity and --ops must be at least {2 * PREFILL}, --repeat at least 1")
    results = measure(names, args.capacity, args.ops, args.repeat)
    print(f"policy calls per stored block, ns (median of {args.repeat}, the clock's own cost taken off), "
          f"capacity {args.capacity:,}")
    for shape, by_policy in results.items():
        print(f"\n{shape}")
        print(f"{'policy':<14}" + "".join(f"{op:>11}" for op in OPS) + f"{'total':>11}{'x lru':>8}")
        lru_total = sum(by_policy["lru"].values())
        for name, by_op in by_policy.items():
            total = sum(by_op.values())
            cells = "".join(f"{by_op[op]:>11.0f}" for op in OPS)
            print(f"{name:<14}{cells}{total:>11.0f}{total / lru_total:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
