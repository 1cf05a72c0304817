"""One engine of the two-process shared-root race (tests/tiers/test_fs_hostile.py, benchmarks/chaos.py).

Usage: ``python fs_race_child.py ROOT SEED SECONDS [BLOCK_BYTES]``. Stores and loads keys of a
shared pool through a FilesystemTier on ROOT (small budget, so it evicts and recycles
files constantly) for SECONDS, checking every loaded block against the content that
key must have. Prints one JSON line of counters.
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


def main() -> None:
    root, seed, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    bb = int(sys.argv[4]) if len(sys.argv) > 4 else 16 * 1024
    pool = 48
    rows = AlignedRows(16, bb).rows
    tier = make_tier(root, rows, bb, max_bytes=12 * entry_bytes(bb), read_threads=3, write_threads=2,
                     direct_io=False)  # fmt: skip
    rng = random.Random(seed)
    keys = [key_of(i, b"shared-root") for i in range(pool)]
    loads_ok = wrong = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            batch = rng.sample(keys, 4)
            fill(rows, range(4), batch, bb)
            store(tier, batch, range(4))
            present = [k for k in rng.sample(keys, 12) if k in tier._index][:4]
            if not present:
                continue
            rows[8:12] = 0
            result = load(tier, present, range(8, 8 + len(present)))
            for i, key in enumerate(present):
                if key in result.succeeded([key]):
                    if np.array_equal(rows[8 + i, :bb], block_bytes_for(key, bb)):
                        loads_ok += 1
                    else:
                        wrong += 1
    finally:
        tier.shutdown()
    print(json.dumps({
        "loads_ok": loads_ok,
        "wrong_bytes": wrong,
        "corrupt": tier.stats.corrupt_values,
        "vanished": tier.stats.extra["vanished"],
        "evictions": tier.stats.evictions,
        "stores": tier.stats.stores_submitted,
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
