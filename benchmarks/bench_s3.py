"""Store and load GB/s through the S3 tier against raw obstore PUT/GET, same server, same run.

    .venv/bin/python benchmarks/bench_s3.py                   # starts moto on a free loopback port
    .venv/bin/python benchmarks/bench_s3.py --endpoint http://127.0.0.1:9000 --bucket bench
        # any S3-compatible server (MinIO, Ceph RGW...); the bucket must exist; credentials from
        # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or --access-key / --secret-key)

The baseline is obstore itself, as fast as it goes: PUTs of ready-made distinct
``bytes`` objects (header and payload already joined, no checksum computed)
and GETs returning obstore's buffer (no copy into a destination, nothing
verified), from as many threads as the tier has requests in flight. The tier
does more: it computes the xxh3 checksum and the header of every block and
uploads header + a view of the CPU row as one body; on load it streams the
body into the CPU row and verifies header and checksum. Both move the same
objects (same sizes, same keys layout) to the same server. Figures are best of
N rounds, the four runs alternating within each round; the ratio is tier /
raw (target >= 0.80).

Against moto both sides are bound by the server (a Python process); take the
ratio against a faster server with --endpoint when one is at hand.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from common import check_succeeded, interleaved_best, submit_in_jobs, wait_all
from kvtier.keys import KVGeometry, Namespace, chain_ids
from kvtier.tiers.base import TierContext
from kvtier.tiers.format import HEADER_SIZE, encode_header
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.s3_store import S3TierOptions, open_store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "tiers"))


@contextmanager
def moto_endpoint() -> Iterator[str]:
    from s3_servers import moto_available, start_moto

    if not moto_available():
        sys.exit("moto is not installed (pip install -e '.[test]'), or pass --endpoint")
    with tempfile.TemporaryDirectory() as workdir:
        server = start_moto(Path(workdir))
        try:
            yield server.endpoint
        finally:
            server.stop()


def bench_size(
    options: dict[str, Any], block_bytes: int, total_bytes: int, job_blocks: int, rounds: int
) -> dict[str, float]:
    import obstore as obs

    n = max(job_blocks, total_bytes // block_bytes)
    value_bytes = HEADER_SIZE + block_bytes
    nbytes = n * value_bytes
    ns = Namespace(f"bench-{uuid.uuid4().hex[:8]}", KVGeometry.from_block_bytes(block_bytes))
    keys = chain_ids(range(n), ns)
    rng = np.random.default_rng(0)
    rows = np.zeros((2 * n, block_bytes), dtype=np.uint8)
    rows[:n] = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)

    tier_options = {**options, "max_queued_stores": 1 << 20, "hit_seconds": 3600.0}
    store = open_store(S3TierOptions(**tier_options))
    threads = int(tier_options.get("max_in_flight", 32))
    # The baseline's objects: the same sizes, distinct contents, in a sibling prefix.
    raw_paths = [f"{options.get('prefix', 'kvtier')}-raw/{k.hex()[:2]}/{k.hex()}" for k in keys]
    values = [encode_header(ns.digest, k, rows[i]) + rows[i].tobytes() for i, k in enumerate(keys)]

    def raw_put(i: int) -> None:
        obs.put(store, raw_paths[i], values[i], use_multipart=False)

    def raw_get(i: int) -> None:
        got = obs.get(store, raw_paths[i]).bytes()
        assert len(got) == value_bytes

    pool = ThreadPoolExecutor(threads)
    tier = S3Tier(TierContext(rows, block_bytes, ns), **tier_options)
    job_ids = iter(range(1 << 30))
    try:

        def raw_store() -> None:
            list(pool.map(raw_put, range(n)))

        def raw_load() -> None:
            list(pool.map(raw_get, range(n)))

        def tier_store() -> None:
            # The tier skips keys it knows it holds: forget them, so every round uploads everything.
            with tier._lock:
                tier._present.clear()
            check_succeeded(wait_all(tier, submit_in_jobs(tier, keys, job_blocks, job_ids, load=False, first_row=0)))

        def tier_load() -> None:
            check_succeeded(wait_all(tier, submit_in_jobs(tier, keys, job_blocks, job_ids, load=True, first_row=n)))

        runs = {"raw_store": raw_store, "tier_store": tier_store, "raw_load": raw_load, "tier_load": tier_load}
        result = interleaved_best(nbytes, rounds, runs)
        assert np.array_equal(rows[n:], rows[:n]), "loaded bytes differ from stored bytes"
    finally:
        tier.shutdown()
        pool.shutdown()
        obs.delete(store, raw_paths)
        obs.delete(store, [tier.object_path(k) for k in keys])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", help="an S3-compatible endpoint to use instead of starting moto")
    parser.add_argument("--bucket", default=None, help="bucket (created on moto; must exist elsewhere)")
    parser.add_argument("--region", default=os.environ.get("AWS_REGION", "us-east-1"))
    parser.add_argument("--access-key", default=os.environ.get("AWS_ACCESS_KEY_ID", "testing"))
    parser.add_argument("--secret-key", default=os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"))
    parser.add_argument("--total-mib", type=int, default=64, help="bytes moved per run (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per measurement; best is kept")
    parser.add_argument("--job-blocks", type=int, default=4, help="blocks per tier job (default 4)")
    parser.add_argument("--in-flight", type=int, default=32, help="requests in flight, tier and raw (default 32)")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[2, 16])
    args = parser.parse_args()

    def run(endpoint: str, bucket: str) -> None:
        options: dict[str, Any] = {
            "bucket": bucket,
            "endpoint": endpoint,
            "allow_http": endpoint.startswith("http://"),
            "region": args.region,
            "access_key_id": args.access_key,
            "secret_access_key": args.secret_key,
            "max_in_flight": args.in_flight,
            "request_timeout": 120.0,
            "job_timeout": 600.0,
        }
        print(
            f"s3 tier vs raw obstore at {endpoint}: {args.total_mib} MiB per run, best of {args.rounds}, "
            f"{args.in_flight} requests in flight, {args.job_blocks} blocks per tier job"
        )
        print(f"{'block':>8} {'op':>6} {'raw GB/s':>9} {'tier GB/s':>10} {'ratio':>6}")
        for mib in args.sizes_mib:
            r = bench_size(options, mib << 20, args.total_mib << 20, args.job_blocks, args.rounds)
            for op in ("store", "load"):
                raw, tier = r[f"raw_{op}"], r[f"tier_{op}"]
                print(f"{mib:>5}MiB {op:>6} {raw:>9.3f} {tier:>10.3f} {tier / raw:>6.2f}")

    if args.endpoint:
        if args.bucket is None:
            sys.exit("--endpoint needs --bucket (an existing bucket)")
        run(args.endpoint, args.bucket)
    else:
        with moto_endpoint() as endpoint:
            import urllib.request

            bucket = args.bucket or "kvtier-bench"
            with urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT"), timeout=10):
                pass
            run(endpoint, bucket)


if __name__ == "__main__":
    main()
