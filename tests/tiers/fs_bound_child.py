"""One engine of the shared-bound tests (tests/tiers/test_fs_share.py): a FilesystemTier with live
sharing on ROOT, all engines with the same small budget, storing and loading keys of one shared
pool as fast as it can, so they evict (and recycle) each other's files all the time.

Usage: ``python fs_bound_child.py ROOT SEED SECONDS BUDGET_FILES``. Prints ``ready`` once its tier
is up, waits for a line on stdin, runs, and prints one JSON line of counters. Every block loaded
is checked against the content its key must have (``wrong_bytes``). Keys are looked up as an
engine does, so blocks another engine wrote are
learned from their journals (``journal_added``) and loaded too.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from fs_helpers import AlignedRows, block_bytes_for, fill, key_of, load, make_tier, store

from kvtier.tiers.fs_layout import entry_bytes
from kvtier.types import LookupResult, RequestContext

BB = 16 * 1024
POOL = 96


def main() -> None:
    root, seed, seconds, budget = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    rows = AlignedRows(16, BB).rows
    tier = make_tier(root, rows, BB, max_bytes=budget * entry_bytes(BB), read_threads=2, write_threads=2,
                     direct_io=False)  # fmt: skip
    rng = random.Random(seed)
    keys = [key_of(i, b"bound") for i in range(POOL)]
    print("ready", flush=True)
    sys.stdin.readline()
    counters = {"loads_ok": 0, "wrong_bytes": 0, "stores_ok": 0}
    deadline = time.monotonic() + seconds
    step = 0
    try:
        while time.monotonic() < deadline:
            batch = rng.sample(keys, 4)
            fill(rows, range(4), batch, BB)
            counters["stores_ok"] += len(store(tier, batch, range(4)).succeeded(batch))
            wanted = rng.sample(keys, 6)
            request = RequestContext(f"r{step}")
            step += 1
            answers = [tier.lookup(k, request) for k in wanted]
            if LookupResult.RETRY in answers:
                tier.on_schedule_end()
                while tier.has_pending_work():
                    time.sleep(0.0005)
                answers = [tier.lookup(k, request) for k in wanted]
            hits = [k for k, a in zip(wanted, answers, strict=True) if a is LookupResult.HIT][:4]
            if not hits:
                continue
            rows[8:12] = 0
            result = load(tier, hits, range(8, 8 + len(hits)))
            for i, key in enumerate(hits):
                if key in result.succeeded([key]):
                    if np.array_equal(rows[8 + i, :BB], block_bytes_for(key, BB)):
                        counters["loads_ok"] += 1
                    else:
                        counters["wrong_bytes"] += 1
    finally:
        tier.shutdown()
    counters.update(
        corrupt=tier.stats.corrupt_values, vanished=int(tier.stats.extra["vanished"]),
        evictions=tier.stats.evictions, journal_added=int(tier.stats.extra["journal_added"]),
        io_errors=int(tier.stats.extra["io_errors"]),
    )  # fmt: skip
    print(json.dumps(counters), flush=True)


if __name__ == "__main__":
    main()
