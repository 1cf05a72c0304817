"""One engine of the shared-fs-root tests (tests/tiers/test_fs_share.py): a real TieringManager
(public API: ``TieringManager.create`` with an fs tier) on ROOT, driven by one command per stdin
line, answering one JSON line per command on stdout.

Usage: ``python fs_share_child.py ROOT MAX_BYTES [OPTIONS_JSON]``. Commands:

* ``store TAG N``: store the N blocks of prompt TAG (device -> CPU -> fs) and wait until the fs
  tier has them. A block's bytes are a function of its key (``block_bytes_for``), so any engine
  can check any block it loads.
* ``fetch TAG N``: look the prompt up step by step until the answer settles, load its leading
  hits and compare every byte.
* ``write SECONDS SEED``: store random prompts (shared with the other writers) for SECONDS; the
  kill -9 test kills it in the middle. Prints ``writing`` first.
* ``stats``: the fs tier's counters and description. ``quit``: shut down and exit.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from fs_helpers import block_bytes_for

from kvtier import KVGeometry, LookupResult, Namespace, RequestContext, TieringManager
from kvtier.keys import BlockKey, prefix_keys

BB = 16 * 1024
BLOCK_TOKENS = 16
NS = Namespace("test/fs-share", KVGeometry.from_block_bytes(BB))
CPU_BLOCKS = 64
_requests = itertools.count(1)


def prompt_keys(tag: str, n: int) -> list[BlockKey]:
    """The block keys of prompt ``tag`` (``n`` blocks), the same in every process."""
    seed = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "little")
    tokens = np.random.default_rng(seed).integers(0, 50_000, n * BLOCK_TOKENS)
    return prefix_keys(tokens, BLOCK_TOKENS, namespace=NS)


class Engine:
    def __init__(self, root: str, max_bytes: int, options: dict[str, Any]) -> None:
        tier = {"type": "fs", "root": root, "max_bytes": max_bytes, "read_threads": 2, "write_threads": 2}
        tier.update(options)
        self.mgr = TieringManager.create(namespace=NS, num_cpu_blocks=CPU_BLOCKS, tiers=[tier])

    def settle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.mgr.has_pending_work():
            if time.monotonic() > deadline:
                raise TimeoutError("tier jobs did not finish")
            self.mgr.on_schedule_end()
            time.sleep(0.001)
        self.mgr.on_schedule_end()

    def store(self, tag: str, n: int) -> dict[str, Any]:
        keys = prompt_keys(tag, n)
        req = RequestContext(f"store-{next(_requests)}")
        self.mgr.on_new_request(req)
        plan = self.mgr.prepare_store(keys, req)
        stored = 0
        if plan is not None:
            for key, slot in zip(plan.keys_to_store, plan.slots, strict=True):
                self.mgr.rows[slot, :BB] = block_bytes_for(key, BB)
            self.mgr.complete_store(plan.keys_to_store, req)
            stored = len(plan.keys_to_store)
        self.mgr.on_request_finished(req)
        self.settle()
        return {"stored": stored}

    def fetch(self, tag: str, n: int, timeout: float = 30.0) -> dict[str, Any]:
        keys = prompt_keys(tag, n)
        req = RequestContext(f"fetch-{next(_requests)}")
        self.mgr.on_new_request(req)
        deadline = time.monotonic() + timeout
        steps = 0
        while True:
            steps += 1
            found = self.mgr.lookup_prefix(keys, req)
            if not found.deferred:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"lookups still deferred: {[a.name for a in found.answers]}")
            self.mgr.on_schedule_end()
            time.sleep(0.002)
        hits = found.ready
        wrong = 0
        if hits:
            slots = self.mgr.prepare_load(keys[:hits], req)
            for key, slot in zip(keys[:hits], slots, strict=True):
                wrong += not np.array_equal(self.mgr.rows[slot, :BB], block_bytes_for(key, BB))
            self.mgr.complete_load(keys[:hits], req)
        self.mgr.on_request_finished(req)
        self.mgr.on_schedule_end()
        first = [a.name for a in found.answers[:1]]
        return {"hits": hits, "wrong": wrong, "steps": steps, "first": first,
                "misses": sum(a is LookupResult.MISS for a in found.answers)}  # fmt: skip

    def write(self, seconds: float, seed: int) -> dict[str, Any]:
        rng = random.Random(seed)
        print("writing", flush=True)
        deadline = time.monotonic() + seconds
        stores = 0
        while time.monotonic() < deadline:
            self.store(f"pool-{rng.randrange(40)}", rng.randrange(1, 9))
            stores += 1
        return {"stores": stores}

    def stats(self) -> dict[str, Any]:
        tier = self.mgr.tiers[0]
        counters = self.mgr.stats().tier("1:fs").counters
        numbers = {k: v for k, v in counters.items() if isinstance(v, (int, float))}
        return {"stats": numbers, "describe": tier.describe()}


def main() -> None:
    root, max_bytes = sys.argv[1], int(sys.argv[2])
    options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    engine = Engine(root, max_bytes, options)
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "quit":
                break
            if cmd == "store":
                out = engine.store(args[0], int(args[1]))
            elif cmd == "fetch":
                out = engine.fetch(args[0], int(args[1]))
            elif cmd == "write":
                out = engine.write(float(args[0]), int(args[1]))
            elif cmd == "stats":
                out = engine.stats()
            else:
                out = {"error": f"unknown command {cmd!r}"}
            print(json.dumps(out, default=str), flush=True)
    finally:
        engine.mgr.shutdown()


if __name__ == "__main__":
    main()
