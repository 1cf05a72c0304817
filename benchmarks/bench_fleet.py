"""The fleet index's costs: answering a prompt's longest cached prefix, and applying events.

* **Answers**: ``FleetIndex.prefix`` for prompts of 32 to 2048 blocks, over an index of
  ``--keys`` block keys spread over ``--engines`` engines (device cache, CPU tier, one shared
  store), as microseconds per answer and nanoseconds per block, with the same-run baseline
  of reading one dict entry per block (the least any per-block answer can cost). Linear in the
  prompt and flat in the index size is the claim (issue 23: O(prefix length)).
* **Hashing**: ``BlockHasher.event_hashes`` (vLLM's sha256 chain) per block, for prompts given
  as tokens.
* **Events**: ``FleetIndex.apply`` per block event (batches of 16 stores, shared-store events
  with their timed control records, as kvtier publishes them).
* **Answers during a clear**: the longest wait of a reader reading 64 keys' masks over and over
  while a location of ``--clear-keys`` keys is cleared (an engine restarted, or lost events),
  against its longest wait in the same time with nothing cleared.

Run::

    .venv/bin/python benchmarks/bench_fleet.py --keys 200000 --engines 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

from kvtier.engine_events import ControlRecord, TierInfo
from kvtier.fleet import BlockHasher, FleetIndex, MemoryMasks
from kvtier.fleet.records import Kind, WireBatch, WireEvent

TIERS = (TierInfo("0:primary", "cpu", "cpu", "engine"), TierInfo("1:fs", "fs", "disk", "shared", "root-1"))


def _control(engine: str, seq: int, op: str = "events") -> WireEvent:
    tiers = TIERS if op != "events" else ()
    record = ControlRecord(op, engine, "start", seq, time.time(), tiers, {"tokens_per_hash": 16} if tiers else {})
    return WireEvent(Kind.CONTROL, control=record)


def build(keys: int, engines: int, seed: int = 7) -> tuple[FleetIndex, list[list[int]]]:
    """An index holding ``keys`` keys in chains of 64 (prompts), spread over the engines' tiers."""
    rng = random.Random(seed)
    names = [f"e{i}" for i in range(engines)]
    index = FleetIndex(names)
    chains: list[list[int]] = []
    for name in names:
        index.apply(name, WireBatch(time.time(), [_control(name, 0, "hello")], 0))
    seqs = dict.fromkeys(names, 1)
    for c in range(keys // 64):
        chain = [rng.getrandbits(64) for _ in range(64)]
        chains.append(chain)
        name = names[c % engines]
        cut = rng.randrange(16, 64)
        events = [_control(name, seqs[name]), WireEvent(Kind.STORED, tuple(chain[:cut]), "GPU"),
                  WireEvent(Kind.STORED, tuple(chain[: cut + 8]), "CPU"),
                  WireEvent(Kind.STORED, tuple(chain), "STORAGE", "1:fs")]  # fmt: skip
        seqs[name] += 1
        index.apply(name, WireBatch(time.time(), events, 0))
    return index, chains


def _timed(fn: object, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
    return best


def reader_waits(keys: int, clear: bool) -> tuple[float, float]:
    """(longest wait of one 64-key ``masks`` read, seconds the clear took) while a location of
    ``keys`` keys is cleared (``clear``), or for as long with nothing cleared."""
    store = MemoryMasks(max_keys=2 * keys + 64)
    store.add(1, range(keys))
    store.add(2, range(keys, keys + 64))
    probe = list(range(keys, keys + 64))
    done = threading.Event()
    worst = [0.0]

    def read() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            store.masks(probe)
            worst[0] = max(worst[0], time.perf_counter() - t0)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    if clear:
        store.clear(1)
    else:
        time.sleep(0.2)
    took = time.perf_counter() - t0
    done.set()
    reader.join()
    return worst[0], took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=200_000, help="block keys in the index")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--queries", type=int, default=200, help="answers per prompt length and round")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--clear-keys", type=int, default=1_000_000, help="keys of the location cleared")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    index, chains = build(args.keys, args.engines)
    build_s = time.perf_counter() - started
    events = sum(3 * len(c) for c in chains)
    print(f"index: {args.keys} keys, {args.engines} engines, built from {events} block events in {build_s:.2f} s "
          f"({build_s / events * 1e9:.0f} ns per block event applied)")  # fmt: skip
    rng = random.Random(1)
    mask = {k: 1 for c in chains for k in c}
    print(f"{'prompt blocks':>14} {'us/answer':>10} {'ns/block':>9} {'dict ns/block':>14} {'ratio':>6}")
    per_block = []
    for blocks in (32, 128, 512, 2048):
        prompts = []
        for _ in range(args.queries):
            prefix: list[int] = []
            while len(prefix) < blocks:
                prefix.extend(rng.choice(chains))
            prompts.append(prefix[:blocks])

        def answer(prompts: list[list[int]] = prompts) -> None:
            for p in prompts:
                index.prefix(p)

        def baseline(prompts: list[list[int]] = prompts) -> None:
            get = mask.get
            for p in prompts:
                for k in p:
                    get(k, 0)

        t_answer = _timed(answer, args.repeat) / args.queries
        t_base = _timed(baseline, args.repeat) / args.queries
        per_block.append(t_answer / blocks * 1e9)
        print(f"{blocks:>14} {t_answer * 1e6:>10.1f} {t_answer / blocks * 1e9:>9.0f} {t_base / blocks * 1e9:>14.0f} "
              f"{t_answer / t_base:>6.1f}")  # fmt: skip
    spread = max(per_block[1:]) / min(per_block[1:])
    print(f"per-block cost from 128 to 2048 blocks within 1.5x of each other (linear): "
          f"{'MET' if spread <= 1.5 else 'MISSED'} ({spread:.2f}x)")
    hasher = BlockHasher("sha256", None, 16)
    tokens = [rng.randrange(50_000) for _ in range(16 * 512)]
    t_hash = _timed(lambda: hasher.event_hashes(tokens), args.repeat)
    print(f"hashing tokens (sha256 chain): {t_hash / 512 * 1e9:.0f} ns per block of 16 tokens")
    print(f"median answer cost per block: {statistics.median(per_block):.0f} ns")
    idle = max(reader_waits(args.clear_keys, False)[0] for _ in range(args.repeat))
    runs = [reader_waits(args.clear_keys, True) for _ in range(args.repeat)]
    during = max(w for w, _ in runs)
    print(f"clearing a location of {args.clear_keys:,} keys took {min(t for _, t in runs) * 1e3:.0f} ms; a 64-key "
          f"read waited at most {during * 1e3:.2f} ms meanwhile, {idle * 1e3:.2f} ms with nothing cleared "
          f"({during / idle:.1f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
