"""Crash safety of the filesystem tier: a child process storing in a loop is killed with
SIGKILL at random moments; a new process over the same root must serve only byte-exact
blocks and leave no temp files behind."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fs_helpers import AlignedRows, block_bytes_for, key_of, load, make_tier, temp_files

from kvtier.tiers.fs_layout import entry_bytes

BB = 256 * 1024
POOL = 120  # keys cycle over a small pool, so restarts also see skips and evictions

_CHILD = r"""
import random, sys
sys.path.insert(0, sys.argv[1])
from fs_helpers import AlignedRows, fill, key_of, make_tier, store
from kvtier.tiers.fs_layout import entry_bytes

root, seed, bb, pool = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
rows = AlignedRows(8, bb).rows
tier = make_tier(root, rows, bb, max_bytes=60 * entry_bytes(bb), scan_in_background=True,
                 write_threads=2)
rng = random.Random(seed)
print("ready", flush=True)
while True:
    keys = [key_of(j, b"crash") for j in rng.sample(range(pool), 4)]
    fill(rows, range(4), keys, bb)
    store(tier, keys, range(4))
"""


def _run_and_kill(root: Path, seed: int, rng: random.Random) -> int:
    """Run one child, SIGKILL it mid-stream; returns how many temp files it left behind."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(Path(__file__).parent), str(root), str(seed), str(BB), str(POOL)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip() == "ready", f"child failed to start: {line!r} {child.stderr.read() if child.stderr else ''}"
        time.sleep(rng.uniform(0.02, 0.35))
        assert child.poll() is None, "child died on its own"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        if child.stdout:
            child.stdout.close()
        if child.stderr:
            child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    return len(temp_files(root))


@pytest.mark.parametrize("kills", [3, pytest.param(20, marks=pytest.mark.slow)])
def test_sigkill_while_storing_never_serves_bad_bytes(tmp_path: Path, kills: int) -> None:
    rng = random.Random(kills)
    left = [_run_and_kill(tmp_path, seed=1000 * kills + i, rng=rng) for i in range(kills)]
    print(f"temp files left by each killed child: {left}")

    region = AlignedRows(8, BB)
    rows = region.rows
    tier = make_tier(tmp_path, rows, BB, max_bytes=60 * entry_bytes(BB))
    try:
        assert temp_files(tmp_path) == [], "orphaned temp files survived the restart"
        assert tier.swept_temp_files == left[-1]
        present = [k for k in (key_of(j, b"crash") for j in range(POOL)) if k in tier._index]
        assert present, "the children stored nothing"
        for key in present:
            rows[0] = 0
            result = load(tier, [key], [0])
            assert result.success, result.error
            assert np.array_equal(rows[0, :BB], block_bytes_for(key, BB))
        assert tier.stats.corrupt_values == 0
        assert tier.usage().used_bytes <= 60 * entry_bytes(BB)
    finally:
        tier.shutdown()
