"""Store and load GB/s through RedisTier against a raw redis-py pipeline, same run, same server.

    .venv/bin/python benchmarks/bench_redis.py              # starts redis-server on a free port
    .venv/bin/python benchmarks/bench_redis.py --url redis://127.0.0.1:6379/0   # an existing server (FLUSHDB!)

For each value size the baseline is a plain redis-py pipeline (``transaction=False``)
of SETs of ready-made distinct ``bytes`` values and of GETs returning ``bytes`` (no copy
into a destination). The tier does more: it reads payloads from CPU rows,
writes a 128-byte header with an xxh3 checksum, reads GET replies straight
into CPU rows and verifies them. The tier's jobs (``--job-blocks`` blocks each)
run on its I/O threads; the bench waits for them with ``drain()`` (an engine
polls once per step, not thousands of times a second). Figures are best-of-N
rounds, the four runs alternating within each round (the order reversed every
other round); the printed ratio is tier / baseline, with the targets: stores >=
1.0x, loads >= 3.5x. Default run: well under a minute.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import redis

from common import check_succeeded, interleaved_best, submit_in_jobs
from kvtier.keys import KVGeometry, Namespace, chain_ids
from kvtier.tiers.base import JobResult, TierContext
from kvtier.tiers.format import HEADER_SIZE
from kvtier.tiers.redis import RedisTier


@contextmanager
def redis_server() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server not found: apt-get install -y redis-server, or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                workdir,
                "--protected-mode",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"redis://127.0.0.1:{port}/0"
            client = redis.Redis.from_url(url)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            client.close()
            yield url
        finally:
            proc.kill()
            proc.wait()


TARGETS = {"store": 1.0, "load": 3.5}


def wait_all(tier: RedisTier, n: int) -> list[JobResult]:
    """Block until the tier finished its jobs, then collect the ``n`` results."""
    tier.drain(timeout=120)
    out = tier.poll_finished()
    if len(out) != n:
        raise SystemExit(f"expected {n} job results, got {len(out)}")
    return out


def bench_size(
    url: str, block_bytes: int, total_bytes: int, job_blocks: int, rounds: int, io_threads: int
) -> dict[str, float]:
    n = max(job_blocks, total_bytes // block_bytes)
    value_bytes = HEADER_SIZE + block_bytes
    nbytes = n * value_bytes
    client = redis.Redis.from_url(url)
    ns = Namespace("bench", KVGeometry.from_block_bytes(block_bytes))
    keys = chain_ids(range(n), ns)

    # Baseline: raw redis-py pipeline with the same value sizes.
    raw_keys = [b"raw:" + k.hex().encode() for k in keys]
    rng = np.random.default_rng(0)
    # n distinct values, like the tier's n distinct rows (a few reused values would sit in cache).
    values = [rng.integers(0, 256, value_bytes, dtype=np.uint8).tobytes() for _ in range(n)]

    def raw_store() -> None:
        pipe = client.pipeline(transaction=False)
        for i, k in enumerate(raw_keys):
            pipe.set(k, values[i])
        pipe.execute()

    def raw_load() -> None:
        pipe = client.pipeline(transaction=False)
        for k in raw_keys:
            pipe.get(k)
        got = pipe.execute()
        assert all(v is not None and len(v) == value_bytes for v in got)

    client.flushdb()

    rows = np.zeros((2 * n, block_bytes), dtype=np.uint8)
    rows[:n] = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    tier = RedisTier(
        TierContext(rows, block_bytes, ns),
        url=url,
        io_threads=io_threads,
        lookup_cache_seconds=0.0,
        max_queued_stores=1 << 20,
    )
    job_ids = iter(range(1 << 30))
    try:

        def tier_store() -> None:
            check_succeeded(wait_all(tier, submit_in_jobs(tier, keys, job_blocks, job_ids, load=False, first_row=0)))

        def tier_load() -> None:
            check_succeeded(wait_all(tier, submit_in_jobs(tier, keys, job_blocks, job_ids, load=True, first_row=n)))

        # Stores overwrite the previous round's values, alike for both clients.
        runs = {"raw_store": raw_store, "tier_store": tier_store, "raw_load": raw_load, "tier_load": tier_load}
        result = interleaved_best(nbytes, rounds, runs)
        assert np.array_equal(rows[n:], rows[:n]), "loaded bytes differ from stored bytes"
    finally:
        tier.shutdown()
        client.flushdb()
        client.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="use this server instead of starting one (it gets FLUSHDB)")
    parser.add_argument("--total-mib", type=int, default=128, help="bytes moved per round (default 128)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per measurement; best is kept")
    parser.add_argument("--job-blocks", type=int, default=16, help="blocks per tier job (default 16)")
    parser.add_argument("--io-threads", type=int, default=2, help="tier I/O threads (default 2)")
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[256, 2048])
    args = parser.parse_args()

    def run(url: str) -> None:
        print(
            f"redis tier vs raw redis-py pipeline: {args.total_mib} MiB per round, best of "
            f"{args.rounds}, {args.job_blocks} blocks per job, {args.io_threads} tier I/O threads"
        )
        print(f"{'value':>8} {'op':>6} {'raw GB/s':>9} {'tier GB/s':>10} {'ratio':>6} {'target':>7}")
        for kib in args.sizes_kib:
            r = bench_size(url, kib * 1024, args.total_mib << 20, args.job_blocks, args.rounds, args.io_threads)
            for op in ("store", "load"):
                raw, tier = r[f"raw_{op}"], r[f"tier_{op}"]
                ratio = tier / raw
                verdict = "MET" if ratio >= TARGETS[op] else "MISSED"
                print(f"{kib:>5}KiB {op:>6} {raw:>9.2f} {tier:>10.2f} {ratio:>6.2f} {verdict:>7} (>= {TARGETS[op]}x)")

    if args.url:
        run(args.url)
    else:
        with redis_server() as url:
            run(url)


if __name__ == "__main__":
    main()
