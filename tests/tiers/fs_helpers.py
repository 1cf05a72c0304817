"""Helpers for the filesystem-tier tests: page-aligned CPU rows, deterministic blocks, job runner.

Imported by ``tests/tiers/test_fs*.py`` (pytest puts this directory on ``sys.path``)
and by the crash-test child process (which adds it explicitly).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import mmap
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.keys import KVGeometry, Namespace
from kvtier.tiers.base import JobResult, TierContext, TransferJob
from kvtier.tiers.fs import FilesystemTier

PAGE = 4096
_job_ids = itertools.count(1)


def namespace(block_bytes: int, model_id: str = "test/fs-model") -> Namespace:
    return Namespace(model_id=model_id, geometry=KVGeometry.from_block_bytes(block_bytes))


class AlignedRows:
    """``num_rows`` page-aligned rows of ``row_bytes`` (rounded up to a page) in anonymous mmap."""

    def __init__(self, num_rows: int, row_bytes: int) -> None:
        self.stride = -(-row_bytes // PAGE) * PAGE
        self._mm = mmap.mmap(-1, num_rows * self.stride)
        self.rows = np.frombuffer(self._mm, dtype=np.uint8).reshape(num_rows, self.stride)

    def close(self) -> None:
        del self.rows
        self._mm.close()


def key_of(i: int, salt: bytes = b"") -> bytes:
    return hashlib.sha256(b"fs-test-key" + salt + i.to_bytes(8, "little")).digest()


def block_bytes_for(key: bytes, n: int) -> np.ndarray:
    """Deterministic content for ``key`` (what the crash test checks against)."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.Generator(np.random.PCG64(seed)).integers(0, 256, n, dtype=np.uint8)


def fill(rows: np.ndarray, slots: Sequence[int], keys: Sequence[bytes], n: int) -> None:
    for slot, key in zip(slots, keys, strict=True):
        rows[slot, :n] = block_bytes_for(key, n)


def make_tier(
    root: Path | str, rows: np.ndarray, block_bytes: int, *, model_id: str = "test/fs-model", **options: Any
) -> FilesystemTier:
    ctx = TierContext(rows=rows, block_bytes=block_bytes, namespace=namespace(block_bytes, model_id))
    options.setdefault("scan_in_background", False)
    options.setdefault("read_threads", 2)
    options.setdefault("write_threads", 1)
    return FilesystemTier(ctx, root=str(root), **options)


def wait_job(tier: FilesystemTier, job_id: int, timeout: float = 30.0) -> JobResult:
    """Poll until ``job_id`` is reported (other results are dropped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for result in tier.poll_finished():
            if result.job_id == job_id:
                return result
        time.sleep(0.001)
    raise AssertionError(f"job {job_id} not reported within {timeout}s")


def store(tier: FilesystemTier, keys: Sequence[bytes], slots: Sequence[int], timeout: float = 30.0) -> JobResult:
    job = TransferJob(next(_job_ids), list(keys), np.asarray(slots, dtype=np.int64), is_promotion=False)
    tier.submit_store(job)
    return wait_job(tier, job.job_id, timeout)


def load(tier: FilesystemTier, keys: Sequence[bytes], slots: Sequence[int], timeout: float = 30.0) -> JobResult:
    job = TransferJob(next(_job_ids), list(keys), np.asarray(slots, dtype=np.int64), is_promotion=True)
    tier.submit_load(job)
    return wait_job(tier, job.job_id, timeout)


def store_three(root: Path, rows: np.ndarray, n: int, salt: bytes) -> list[bytes]:
    """Store three blocks (keys ``key_of(0..2, salt)``, rows 0-2) into an fs tier at ``root`` and
    shut it down: a directory with a manifest and three values to tamper with. Their keys."""
    keys = [key_of(i, salt) for i in range(3)]
    fill(rows, range(3), keys, n)
    tier = make_tier(root, rows, n)
    try:
        assert store(tier, keys, [0, 1, 2]).success
    finally:
        tier.shutdown()
    return keys


def value_files(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*.kv"))


def temp_files(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*.tmp"))


def dir_bytes(root: Path) -> int:
    """Bytes of every value and temp file under ``root``."""
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith((".kv", ".tmp")):
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(dirpath, name)).st_size
    return total


def mount_tmpfs(where: Path, size: str) -> str | None:
    """Mount a tmpfs of ``size`` at ``where``; None on success, else why not (needs root or
    CAP_SYS_ADMIN). Unmount with ``umount -l``."""
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"mount exited {proc.returncode}")
