"""Instructions per block of the scheduler's store paths, per policy: a count that noise does not move.

``bench_manager.py`` times the same paths (16-block stores into a full CPU tier, and decode: one
block a store, each continuing its request); on a shared machine its ratios to LRU move by 0.1 or
more from run to run, more than most changes to a policy. This benchmark counts the CPU
instructions the interpreter executes for them instead, with valgrind's cachegrind (no cache
simulation), which repeats exactly: hash randomization is off (``PYTHONHASHSEED=0``) and each
figure is the difference of two runs of the same child process, so the set-up (imports, filling
the tier) cancels:

* 16-block stores: a run of ``2 x --requests`` stores less a run of ``--requests``, over the blocks
  in between (``bench_manager``'s ``time_stores``: prepare_store + complete_store + request end +
  step, every block evicting one);
* decode: ``--requests`` requests (64 a step) that store 16 blocks, then 16 more one block a store,
  less the same requests without the one-block stores, over those blocks (``time_decode_stores``).

Instructions are not time (a cache miss costs no instruction): confirm a change with
``bench_manager.py`` on a quiet machine. Needs valgrind (Debian's ``valgrind``); without it, says
so and exits 0.

    .venv/bin/python benchmarks/bench_instructions.py                 # about 4 min
    .venv/bin/python benchmarks/bench_instructions.py --blocks 2000 --requests 64 --policy lru,return-time
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

from bench_manager import DECODE_REQUESTS, fill, new_manager, time_decode_stores, time_stores
from common import make_keys

BATCH = 16
"""Blocks of a store (and of a request's decode phase)."""

SHAPES = ("16-block stores", "decode (1-block stores)")


def child(argv: list[str]) -> None:
    """One measured run (under valgrind): ``policy shape requests blocks shm``, ``bench_manager``'s
    operations on a full tier of ``blocks`` (``shape``: stores, decode, or prefill: decode's
    requests without their one-block stores)."""
    policy, shape, requests, blocks, shm = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4]
    mgr = new_manager(blocks, policy, 0, shm)
    try:
        fill(mgr, make_keys("fill", blocks))
        if shape == "stores":
            time_stores(mgr, make_keys("run", requests * BATCH), BATCH)
        else:
            time_decode_stores(mgr, make_keys("run", requests * 2 * BATCH), BATCH, decode=shape == "decode")
    finally:
        mgr.shutdown()


def instructions(valgrind: str, args: list[str], shm: str) -> int:
    """Instructions a child run executed (cachegrind's ``I refs``)."""
    cmd = [valgrind, "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
           sys.executable, os.path.abspath(__file__), "--child", *args, shm]  # fmt: skip
    # One BLAS thread: cachegrind counts every thread, and idle OpenBLAS workers spin.
    env = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=3600)
    found = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if out.returncode != 0 or found is None:
        raise SystemExit(f"child run {args} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def measure(valgrind: str, policy: str, requests: int, blocks: int, shm: str) -> dict[str, float]:
    """Instructions per block for each shape of :data:`SHAPES`."""
    once = instructions(valgrind, [policy, "stores", str(requests), str(blocks)], shm)
    twice = instructions(valgrind, [policy, "stores", str(2 * requests), str(blocks)], shm)
    prefill = instructions(valgrind, [policy, "prefill", str(requests), str(blocks)], shm)
    decode = instructions(valgrind, [policy, "decode", str(requests), str(blocks)], shm)
    return {SHAPES[0]: (twice - once) / (requests * BATCH), SHAPES[1]: (decode - prefill) / (requests * BATCH)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=100_000, help="CPU blocks (default 100,000, as bench_manager)")
    parser.add_argument("--requests", type=int, default=512,
                        help="requests per measured run, a multiple of 64 (default 512)")  # fmt: skip
    parser.add_argument("--policy", default="lru,return-time,arc", help="policies, comma-separated; lru first")
    args = parser.parse_args(argv)
    if args.requests <= 0 or args.requests % DECODE_REQUESTS:
        parser.error(f"--requests must be a positive multiple of {DECODE_REQUESTS}, got {args.requests}")
    if args.blocks < 2 * BATCH * DECODE_REQUESTS:
        parser.error(f"--blocks must be at least {2 * BATCH * DECODE_REQUESTS} (a step of decoding requests)")
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    if "lru" not in policies:
        policies.insert(0, "lru")
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("bench_instructions: valgrind is not installed here (apt-get install valgrind); nothing measured")
        return 0
    print(f"bench_instructions: {args.blocks:,} CPU blocks, {args.requests} requests per run, "
          f"instructions per block (cachegrind), python {sys.version.split()[0]}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvt-bench-instr-", dir="/dev/shm") as shm:
        results = {p: measure(valgrind, p, args.requests, args.blocks, shm) for p in policies}
    for shape in SHAPES:
        print(f"\n{shape}\n{'policy':<14}{'instructions':>14}{'x lru':>8}")
        for policy in policies:
            count = results[policy][shape]
            print(f"{policy:<14}{count:>14,.0f}{count / results['lru'][shape]:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
