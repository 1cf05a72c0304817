"""A separate engine process for the shared-bucket tests: ``store`` or ``load`` blocks through a
real TieringManager whose only secondary tier is S3, and print a JSON summary.

    python s3_child.py store|load ENDPOINT BUCKET MODEL NUM_BLOCKS SHM_DIR

Block ``i`` holds deterministic bytes derived from (MODEL, i), so the loading process can
check them byte for byte without seeing the storing process's memory.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from kvtier.keys import KVGeometry, Namespace, chain_ids
from kvtier.manager import TieringManager
from kvtier.types import LookupResult, RequestContext

BLOCK = 64 * 1024


def content(model: str, i: int) -> np.ndarray:
    seed = int.from_bytes(f"{model}/{i}".encode()[:8].ljust(8, b"\0"), "little") ^ i
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


def main() -> int:
    mode, endpoint, bucket, model, n, shm_dir = sys.argv[1:7]
    count = int(n)
    ns = Namespace(model, KVGeometry.from_block_bytes(BLOCK))
    keys = chain_ids(range(count), ns)
    spec = {
        "type": "s3", "bucket": bucket, "endpoint": endpoint, "allow_http": True,
        "access_key_id": "testing", "secret_access_key": "testing", "max_in_flight": 4,
        # moto is a Python server on the same (loaded, 2-core) CI machine: a step's HEADs took over the
        # 1 s default there, so the first key answered MISS (a timed-out check) and the test failed
        "check_timeout": 10.0,
    }  # fmt: skip
    mgr = TieringManager.create(namespace=ns, num_cpu_blocks=count + 2, tiers=[spec], shm_dir=shm_dir,
                                wait_timeout=25.0)  # fmt: skip
    out: dict[str, object] = {"mode": mode}
    try:
        deadline = time.monotonic() + 30
        if mode == "store":
            plan = mgr.prepare_store(keys)
            assert plan is not None
            for i, slot in enumerate(plan.slots):
                mgr.rows[slot, :BLOCK] = content(model, i)
            mgr.complete_store(keys)
            while mgr.has_pending_work():
                assert time.monotonic() < deadline, "cascades did not finish"
                mgr.on_schedule_end()
                time.sleep(0.005)
            out["cascaded"] = mgr.stats().as_dict()["manager"]["cascades_succeeded"]
        else:
            req = RequestContext("child-load")
            while True:
                answers = [mgr.lookup(k, req) for k in keys]
                if all(a is LookupResult.HIT for a in answers) or LookupResult.MISS in answers:
                    break
                assert time.monotonic() < deadline, f"lookups unresolved: {answers}"
                mgr.on_schedule_end()
                time.sleep(0.005)
            out["answers"] = [a.value for a in answers]
            hits = [k for k, a in zip(keys, answers, strict=True) if a is LookupResult.HIT]
            if hits:
                slots = mgr.prepare_load(hits, req)
                out["byte_exact"] = all(
                    np.array_equal(mgr.rows[slot, :BLOCK], content(model, i)) for i, slot in enumerate(slots)
                )
                mgr.complete_load(hits, req)
            mgr.on_schedule_end()
    finally:
        mgr.shutdown()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
