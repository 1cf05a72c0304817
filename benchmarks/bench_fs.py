"""Filesystem tier throughput against raw os.pwrite/os.pread on the same file system.

For 2 MiB blocks (by default), in one run, on one directory:

* page cache hot: the tier with buffered I/O vs raw buffered pwrite/pread of the
  same bytes (reads hit the page cache: the files were just written);
* cold, O_DIRECT: the tier with O_DIRECT vs raw O_DIRECT pwrite/pread (no page
  cache at all), when the file system supports O_DIRECT.

The raw baseline is one thread writing/reading the blocks sequentially into/from one
file, straight from/into page-aligned memory: the best a single Python thread gets
from this disk. The tier does more per block (one file per block, header, xxh3
checksum on both paths, temp file + rename, index) and runs ``--threads`` I/O
threads. Each pair is measured ``--repeat`` times, interleaved, and the best of each
is compared; the machine is shared and noisy, so read the ratios, not absolute figures.

    .venv/bin/python benchmarks/bench_fs.py                  # ~20-40 s, under /tmp
    .venv/bin/python benchmarks/bench_fs.py --dir /nvme/x --blocks 256 --repeat 5
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import mmap
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from kvtier.keys import KVGeometry, Namespace
from kvtier.tiers.base import TierContext, TransferJob
from kvtier.tiers.fs import FilesystemTier
from kvtier.tiers.fs_layout import O_DIRECT, entry_bytes, probe_direct_io

_job_ids = itertools.count(1)


def _keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def _run_jobs(tier: FilesystemTier, keys: list[bytes], first_slot: int, load: bool, batch: int) -> float:
    """Submit ``keys`` in jobs of ``batch`` blocks, wait for all; returns seconds."""
    t0 = time.perf_counter()
    ids = []
    for start in range(0, len(keys), batch):
        chunk = keys[start : start + batch]
        slots = np.arange(first_slot + start, first_slot + start + len(chunk))
        job = TransferJob(next(_job_ids), chunk, slots, is_promotion=load)
        (tier.submit_load if load else tier.submit_store)(job)
        ids.append(job.job_id)
    tier.drain(timeout=600)
    seconds = time.perf_counter() - t0
    results = tier.poll_finished()
    bad = [r for r in results if not r.success]
    if bad or len(results) != len(ids):
        raise SystemExit(f"tier jobs failed: {bad[:3]}")
    return seconds


def _raw_write(path: Path, rows: np.ndarray, n: int, block: int, direct: bool, fresh: bool) -> float:
    """One thread, ``n`` sequential pwrites into one file (a fresh one, or overwriting)."""
    t0 = time.perf_counter()
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if fresh else 0) | (O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        for i in range(n):
            os.pwrite(fd, rows[i, :block].data, i * block)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _raw_read(path: Path, rows: np.ndarray, n: int, block: int, first_slot: int, direct: bool) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
    try:
        for i in range(n):
            os.preadv(fd, [rows[first_slot + i, :block].data], i * block)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


class _Bench:
    def __init__(self, base: Path, rows: np.ndarray, ns: Namespace, args: argparse.Namespace) -> None:
        self.base, self.rows, self.ns, self.args = base, rows, ns, args
        self.block, self.n = args.block_bytes, args.blocks
        self.gb = self.n * self.block / 1e9
        self._roots = itertools.count()

    def tier(self, direct: bool, threads: str, capacity_blocks: int | None) -> FilesystemTier:
        opts: dict[str, int] = {}
        if threads != "default":
            opts = {"read_threads": int(threads), "write_threads": int(threads)}
        max_bytes = 1 << 40 if capacity_blocks is None else capacity_blocks * entry_bytes(self.block)
        ctx = TierContext(rows=self.rows, block_bytes=self.block, namespace=self.ns)
        tier = FilesystemTier(
            ctx,
            root=str(self.base / f"tier-{next(self._roots)}"),
            max_bytes=max_bytes,
            direct_io=direct,
            scan_in_background=False,
            # Every block of a measurement is submitted at once: none may be shed (the default
            # queue bound is for an engine, which would rather skip a store than wait).
            max_queued_stores=max(self.n, 1),
            **opts,
        )
        assert tier.direct_io is direct
        return tier

    def line(self, label: str, threads: str, op: str, raw_s: float, tier_s: float) -> None:
        print(
            f"{label:<28}{threads:>8}{op:>18}{self.gb / raw_s:>10.2f}{self.gb / tier_s:>11.2f}{raw_s / tier_s:>10.2f}"
        )

    def run(self, label: str, direct: bool, threads: str) -> None:
        n, block, rows, repeat, batch = self.n, self.block, self.rows, self.args.repeat, self.args.batch
        raw_path = self.base / "raw.bin"
        # Stores into an empty tier (every block is a fresh file) vs fresh raw files.
        raw_fresh = tier_fill = float("inf")
        for r in range(repeat):
            raw_fresh = min(raw_fresh, _raw_write(raw_path, rows, n, block, direct, fresh=True))
            tier = self.tier(direct, threads, capacity_blocks=None)
            try:
                tier_fill = min(tier_fill, _run_jobs(tier, _keys(f"fill/{r}", n), 0, False, batch))
            finally:
                _close(tier)
        # Stores into a full tier (each evicts the LRU file and overwrites it) vs raw overwrites.
        tier = self.tier(direct, threads, capacity_blocks=n)
        try:
            shown = threads if threads != "default" else f"{tier.options.read_threads}r/{tier.options.write_threads}w"
            _run_jobs(tier, _keys("warm", n), 0, False, batch)
            raw_over = tier_steady = float("inf")
            keys: list[bytes] = []
            for r in range(repeat):
                raw_over = min(raw_over, _raw_write(raw_path, rows, n, block, direct, fresh=False))
                keys = _keys(f"steady/{r}", n)
                tier_steady = min(tier_steady, _run_jobs(tier, keys, 0, False, batch))
            raw_r = tier_r = float("inf")
            for _ in range(repeat):
                raw_r = min(raw_r, _raw_read(raw_path, rows, n, block, n, direct))
                tier_r = min(tier_r, _run_jobs(tier, keys, n, True, batch))
            if not np.array_equal(rows[:n], rows[n:]):
                raise SystemExit("tier loads returned different bytes")
        finally:
            _close(tier)
        self.line(label, shown, "store empty tier", raw_fresh, tier_fill)
        self.line(label, shown, "store full tier", raw_over, tier_steady)
        self.line(label, shown, "load", raw_r, tier_r)


def _close(tier: FilesystemTier) -> None:
    tier.shutdown()
    shutil.rmtree(tier.root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="directory on the file system to test (default: under /tmp)")
    parser.add_argument("--block-bytes", type=int, default=2 << 20)
    parser.add_argument("--blocks", type=int, default=64, help="blocks per measurement (default 64 = 128 MiB)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="blocks per tier job")
    parser.add_argument(
        "--threads", default="1,default", help="comma list of tier I/O thread counts; 'default' = 4 read / 2 write"
    )
    args = parser.parse_args()

    block, n = args.block_bytes, args.blocks
    base = Path(tempfile.mkdtemp(prefix="kvtier-bench-fs-", dir=args.dir))
    mm = mmap.mmap(-1, 2 * n * block)  # page aligned; slots [0, n) source, [n, 2n) destination
    rows = np.frombuffer(mm, dtype=np.uint8).reshape(2 * n, block)
    rows[:n] = np.random.default_rng(0).integers(0, 256, (n, block), dtype=np.uint8)
    bench = _Bench(base, rows, Namespace("bench/fs", KVGeometry.from_block_bytes(block)), args)
    direct_reason = probe_direct_io(base)
    modes = [("hot (page cache, buffered)", False)]
    if direct_reason is None:
        modes.append(("cold (O_DIRECT)", True))
    print(
        f"bench_fs: {n} x {block / 2**20:.1f} MiB blocks ({bench.gb:.2f} GB) per measurement, "
        f"best of {args.repeat}, dir {base}"
    )
    if direct_reason is not None:
        print(f"  O_DIRECT unavailable here ({direct_reason}): cold measurement skipped")
    print(
        "  raw = 1 thread, sequential os.pwrite/os.preadv of the same bytes on one file (fresh file for "
        "'empty tier', overwritten for 'full tier')"
    )
    print(f"{'mode':<28}{'threads':>8}{'op':>18}{'raw GB/s':>10}{'tier GB/s':>11}{'tier/raw':>10}")
    try:
        for label, direct in modes:
            for threads in args.threads.split(","):
                bench.run(label, direct, threads)
    finally:
        del rows, bench
        # After an error its traceback may still hold a view of the rows: the mapping then goes with the process.
        with contextlib.suppress(BufferError):
            mm.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
