"""Fault injection: hostile files, crashed starts and killed engines never cost wrong KV, a hang or a leak.

In one run, in a private directory of /dev/shm and a private fs tier root:

1. plants hostile entries named like kvtier's own files: a FIFO, a symlink to a file
   outside, a directory, a garbage file, a socket and (as root) a character device and
   another user's file, both in the shm directory (``kvtier-*.shm``) and in the fs
   root (``<namespace>/<shard>/<key>.kv``);
2. alternates two kinds of trials:

   * **crashed start**: 2 of the 3 mappers of a region with a pinned name start and are
     SIGKILLed at a random moment (before, during or after creating the region, always
     before the third attaches), then a new start of 3 mappers with the same name must
     map one region: each writes its row and must read every other's;
   * **engine killed mid-store**: an engine process (TieringManager + fs tier) stores
     blocks whose bytes are a function of their key, reports every block its fs tier
     holds, and is SIGKILLed at a random moment; a new engine process then promotes
     every key from the fs root and checks every byte served;

3. at the end a last engine checks every reported block once more, ``kvtier sweep-shm
   --remove`` runs, and the directories are checked for anything left behind.

Every child process runs under a deadline; one that overruns is a hang. Prints:
trials, hangs, wrong bytes served, split mappings, files left behind, valid values
lost (blocks an engine reported stored that a later engine could not serve), and
whether every hostile entry is still there, untouched. All must be 0 (and intact).

    .venv/bin/python benchmarks/chaos.py                 # ~1-2 min on 2 cores
    .venv/bin/python benchmarks/chaos.py --trials 40 --seed 7
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier import KVGeometry, Namespace

BLOCK_BYTES = 64 * 1024
POOL = 96
NS = Namespace("chaos-model", KVGeometry.from_block_bytes(BLOCK_BYTES))
CHILD_DEADLINE = 60.0
REGION = "chaos-pinned"

_COMMON = textwrap.dedent(
    f"""
    import hashlib, json, random, sys, time
    import numpy as np
    from kvtier import KVGeometry, LookupResult, Namespace, RequestContext, TieringManager
    BB, POOL = {BLOCK_BYTES}, {POOL}
    NS = Namespace("chaos-model", KVGeometry.from_block_bytes(BB))

    def key_of(i):
        return hashlib.sha256(b"chaos" + i.to_bytes(4, "little")).digest() + i.to_bytes(4, "little")

    def content(key):
        seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
        return np.random.Generator(np.random.PCG64(seed)).integers(0, 256, BB, dtype=np.uint8)

    def manager(shm, root):
        import inspect
        known = inspect.signature(TieringManager.create).parameters  # also runs against older releases
        deadline = {{"shutdown_timeout": 20}} if "shutdown_timeout" in known else {{}}
        return TieringManager.create(
            namespace=NS, num_cpu_blocks=16, shm_dir=shm, **deadline,
            tiers=[{{"type": "fs", "root": root, "max_bytes": 4 * POOL * (BB + 8192), "direct_io": False}}],
        )
    """
)

ENGINE = _COMMON + textwrap.dedent(
    """
    shm, root, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mgr = manager(shm, root)
    fs = mgr.tiers[0]
    rng = random.Random(seed)
    print("ready", flush=True)
    while True:
        keys = [key_of(i) for i in rng.sample(range(POOL), 4)]
        plan = mgr.prepare_store(keys)
        if plan is not None:
            rows = mgr.rows
            for key, slot in zip(plan.keys_to_store, plan.slots):
                rows[slot, :BB] = content(key)
            del rows
            mgr.complete_store(plan.keys_to_store)
        for _ in range(200):
            mgr.on_schedule_end()
            if not mgr.has_pending_work():
                break
            time.sleep(0.001)
        held = [k for k in keys if fs.lookup(k, None) is LookupResult.HIT]
        if held:
            print("stored", *[k.hex() for k in held], flush=True)
    """
)

VERIFIER = _COMMON + textwrap.dedent(
    """
    shm, root = sys.argv[1], sys.argv[2]
    expected = set(bytes.fromhex(h) for h in sys.argv[3:])
    mgr = manager(shm, root)
    wrong = lost = served = 0
    req = RequestContext("verify")
    keys = [key_of(i) for i in range(POOL)]
    for key in keys:
        deadline = time.monotonic() + 20
        while True:
            answer = mgr.lookup(key, req)
            if answer is LookupResult.HIT or answer is LookupResult.MISS:
                break
            assert time.monotonic() < deadline, "lookup never settled"
            mgr.on_schedule_end()
            time.sleep(0.001)
        if answer is LookupResult.MISS:
            lost += key in expected
            continue
        slots = mgr.prepare_load([key], req)
        rows = mgr.rows
        wrong += int(np.count_nonzero(rows[slots[0], :BB] != content(key)))
        del rows
        mgr.complete_load([key], req)
        served += 1
        mgr.on_schedule_end()
    stats = mgr.stats().as_dict()["tiers"]["1:fs"]
    mgr.shutdown()
    print(json.dumps({"wrong": wrong, "lost": lost, "served": served, "corrupt": stats["corrupt_values"],
                      "unsafe": stats["extra"]["unsafe_entries"]}), flush=True)
    """
)

MAPPER = textwrap.dedent(
    """
    import sys
    from kvtier.region import SharedRegion
    name, shm, index = sys.argv[1], sys.argv[2], int(sys.argv[3])
    region = SharedRegion(name, 4, 64 << 20, expected_mappers=3, shm_dir=shm, attach_timeout=30)
    rows = region.rows
    rows[index, :8] = index + 1
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "read":
            print("seen", *[int(rows[i, 0]) for i in range(3)], flush=True)
        else:
            del rows
            region.close()
            print("closed", flush=True)
            break
    """
)


@dataclass
class Tally:
    trials: int = 0
    hangs: int = 0
    wrong_bytes: int = 0
    split_mappings: int = 0
    lost: int = 0
    served: int = 0
    corrupt_seen: int = 0
    stale_regions: int = 0
    stored: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)


def _spawn(code: str, *args: str, stdin: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _readline(proc: subprocess.Popen[str], timeout: float) -> str | None:
    """One stdout line, or None if the process did not print one within ``timeout`` (a hang)."""
    import selectors

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    ready = sel.select(timeout)
    sel.close()
    if not ready:
        return None
    return proc.stdout.readline()


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


# --- hostile entries -----------------------------------------------------------------------------


def plant(shm: Path, ns_dir: Path, outside: Path) -> dict[Path, tuple[int, int, bytes | None]]:
    """Plant hostile entries; returns path -> (mode, inode, content or None) to check later."""
    victim = outside / "victim.txt"
    victim.write_bytes(b"precious bytes")
    for i in range(256):
        (ns_dir / f"{i:02x}").mkdir(parents=True, exist_ok=True, mode=0o700)
    ns_dir.chmod(0o700)
    kinds = ["fifo", "link", "garbage", "dir", "sock"] + (["dev", "foreign"] if os.geteuid() == 0 else [])
    made: list[Path] = [victim]
    for n, kind in enumerate(kinds, start=1):
        key = bytes([n]) * 32  # a key no engine uses
        for path in (shm / f"kvtier-hostile-{kind}.shm", ns_dir / f"{key[0]:02x}" / f"{key.hex()}.kv"):
            if kind == "fifo":
                os.mkfifo(path, 0o600)
            elif kind == "link":
                path.symlink_to(victim)
            elif kind == "garbage":
                path.write_bytes(b"\x00garbage" * 5)
            elif kind == "dir":
                path.mkdir()
            elif kind == "sock":
                here = os.getcwd()
                os.chdir(path.parent)  # a relative name: AF_UNIX paths are limited to 108 bytes
                try:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.bind(path.name)
                    sock.close()
                finally:
                    os.chdir(here)
            elif kind == "dev":
                os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # like /dev/null
            else:
                path.write_bytes(b"another user's bytes" * 100)
                os.chown(path, 65534, 65534)
            made.append(path)
    out: dict[Path, tuple[int, int, bytes | None]] = {}
    for path in made:
        st = path.lstat()
        data = path.read_bytes() if stat.S_ISREG(st.st_mode) else None
        out[path] = (st.st_mode, st.st_ino, data)
    return out


def intact(planted: dict[Path, tuple[int, int, bytes | None]]) -> list[str]:
    """The planted entries that were removed, replaced or changed (must be none)."""
    bad = []
    for path, (mode, ino, data) in planted.items():
        try:
            st = path.lstat()
        except FileNotFoundError:
            bad.append(f"{path}: removed")
            continue
        if (st.st_mode, st.st_ino) != (mode, ino) or (data is not None and path.read_bytes() != data):
            bad.append(f"{path}: changed")
    return bad


# --- trials ----------------------------------------------------------------------------------------


def crashed_start(shm: Path, rng: random.Random, tally: Tally) -> None:
    """Two of three mappers start and die at a random moment; a new start of three must share one region."""
    crashed = [_spawn(MAPPER, REGION, str(shm), str(i), stdin=True) for i in range(2)]
    if rng.random() < 0.5:
        time.sleep(rng.uniform(0.0, 1.0))  # anywhere in the start: importing, creating, prefaulting...
    else:
        for proc in crashed:  # ...or inside the unlink window: both mapped, the third not yet there
            _readline(proc, CHILD_DEADLINE)
    for proc in crashed:
        _kill(proc)
    tally.stale_regions += (shm / f"kvtier-{REGION}.shm").exists()  # the crash left the region file
    mappers = [_spawn(MAPPER, REGION, str(shm), str(i), stdin=True) for i in range(3)]
    try:
        for proc in mappers:
            line = _readline(proc, CHILD_DEADLINE)
            if line is None:
                tally.hangs += 1
                return
            if line.strip() != "ready":
                tally.notes.append(f"mapper failed: {line!r} {proc.stderr.read() if proc.stderr else ''}")
                tally.split_mappings += 1
                return
        for proc in mappers:
            assert proc.stdin is not None
            proc.stdin.write("read\n")
            proc.stdin.flush()
            line = _readline(proc, CHILD_DEADLINE)
            if line is None:
                tally.hangs += 1
                return
            if line.split() != ["seen", "1", "2", "3"]:
                tally.split_mappings += 1
                tally.notes.append(f"a mapper saw {line.strip()!r}")
        for proc in mappers:
            assert proc.stdin is not None
            proc.stdin.write("close\n")
            proc.stdin.flush()
            if _readline(proc, CHILD_DEADLINE) is None:
                tally.hangs += 1
    finally:
        for proc in mappers:
            _kill(proc)


def killed_engine(shm: Path, root: Path, rng: random.Random, tally: Tally) -> None:
    """An engine storing blocks is SIGKILLed mid-store; a new engine must serve only exact bytes."""
    engine = _spawn(ENGINE, str(shm), str(root), str(rng.randrange(1 << 30)))
    try:
        line = _readline(engine, CHILD_DEADLINE)
        if line is None:
            tally.hangs += 1
            return
        if line.strip() != "ready":
            tally.notes.append(f"engine failed: {line!r} {engine.stderr.read() if engine.stderr else ''}")
            return
        time.sleep(rng.uniform(0.05, 0.6))
    finally:
        _kill(engine)
    assert engine.stdout is not None
    for out in engine.stdout.read().splitlines():
        if out.startswith("stored "):
            tally.stored.update(out.split()[1:])
    verify(shm, root, tally)


def verify(shm: Path, root: Path, tally: Tally) -> None:
    proc = _spawn(VERIFIER, str(shm), str(root), *sorted(tally.stored))
    try:
        out, err = proc.communicate(timeout=CHILD_DEADLINE)
    except subprocess.TimeoutExpired:
        tally.hangs += 1
        _kill(proc)
        return
    if proc.returncode != 0:
        tally.notes.append(f"verifier failed: {err[-2000:]}")
        tally.lost += len(tally.stored)
        return
    result = json.loads(out.strip().splitlines()[-1])
    tally.wrong_bytes += result["wrong"]
    tally.served += result["served"]
    tally.corrupt_seen += result["corrupt"]
    tally.lost = result["lost"]  # the latest engine's view of everything reported so far


def left_behind(shm: Path, root: Path, planted: dict[Path, tuple[int, int, bytes | None]]) -> list[str]:
    """Region files in the shm directory and temp files / instance dirs in the fs root (must be none)."""
    extra = [str(p) for p in shm.iterdir() if p not in planted]
    for tmp in root.glob("*/tmp/*"):
        extra.append(str(tmp))
    return extra


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials, alternating the two kinds")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    shm = Path(tempfile.mkdtemp(prefix="kvtier-chaos-", dir="/dev/shm"))
    work = Path(tempfile.mkdtemp(prefix="kvtier-chaos-"))
    root = work / "fs-root"
    t0 = time.monotonic()
    try:
        planted = plant(shm, root / NS.hexdigest, work)
        tally = Tally()
        for trial in range(args.trials):
            tally.trials += 1
            if trial % 2 == 0:
                crashed_start(shm, rng, tally)
            else:
                killed_engine(shm, root, rng, tally)
        verify(shm, root, tally)  # a last engine over everything reported stored
        sweep = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "sweep-shm", "--remove", "--shm-dir", str(shm)],
            capture_output=True, text=True, timeout=CHILD_DEADLINE, check=False,
        )  # fmt: skip
        if sweep.returncode != 0:
            tally.notes.append(f"sweep-shm failed: {sweep.stderr[-1000:]}")
        leftovers = left_behind(shm, root, planted)
        damaged = intact(planted)
        hostile = len(planted) - 1  # the victim file is not an entry in a shared directory
        print(f"chaos: {tally.trials} trials ({(tally.trials + 1) // 2} crashed starts, {tally.trials // 2} "
              f"engines killed mid-store) in {time.monotonic() - t0:.0f} s, seed {args.seed}")  # fmt: skip
        print(f"  hostile entries planted  {hostile} ({hostile // 2} in the shm directory, "
              f"{hostile // 2} in the fs root)")  # fmt: skip
        print(f"  trials                   {tally.trials}")
        print(f"  hangs                    {tally.hangs}")
        print(f"  wrong bytes served       {tally.wrong_bytes}  (of {tally.served} blocks served)")
        print(f"  split mappings           {tally.split_mappings}  ({tally.stale_regions} restarts found a dead "
              "start's region file)")  # fmt: skip
        print(f"  files left behind        {len(leftovers)}")
        print(f"  valid values lost        {tally.lost}  (of {len(tally.stored)} reported stored)")
        print(f"  hostile entries intact   {len(planted) - len(damaged)}/{len(planted)} (with the symlinks' target)")
        print(f"  values taken for corrupt {tally.corrupt_seen}")
        print(f"  child failures           {len(tally.notes)}")
        for line in (tally.notes + leftovers + damaged)[:20]:
            print(f"    ! {line}")
        failed = (tally.hangs or tally.wrong_bytes or tally.split_mappings or leftovers or tally.lost or damaged
                  or tally.notes)  # fmt: skip
        return 1 if failed else 0
    finally:
        for fifo in [*shm.glob("*"), *root.rglob("*.kv")]:
            if fifo.is_fifo():
                fifo.unlink()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
