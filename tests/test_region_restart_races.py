"""Restarts and forks around a region (review r3): a restart's worker never joins a start whose
scheduler is gone, a scheduler's failed attach does not mark its start dead, a fork never
inherits a dropped region's mapping, and a fork never waits on a garbage-collected region's
finalizer. Real /dev/shm files, real processes, kill -9."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier.region import SharedRegion

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC}
ROLE = textwrap.dedent("""
    import sys
    from kvtier.region import SharedRegion
    shm, name, scheduler = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    region = SharedRegion(name, 4, 4096, expected_mappers=3, shm_dir=shm, scheduler=scheduler, prefault=False,
                          attach_timeout=5)
    print(region.generation.hex(), flush=True)
    rows = region.rows
    for line in sys.stdin:
        if line.startswith("w"):
            rows[0, 0] = int(line.split()[1])
        print(int(rows[0, 0]), flush=True)
""")


class _Role:
    def __init__(self, shm: Path, name: str, scheduler: bool) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", ROLE, str(shm), name, "1" if scheduler else "0"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
        self.generation = self._line()

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def ask(self, command: str) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return int(self._line())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def test_a_restarted_starts_first_worker_never_joins_the_start_whose_scheduler_is_gone(private_shm: Path) -> None:
    """The old worker created the file, the old scheduler joined and was killed -9 while the old
    worker lived; the new start's workers came before its scheduler. Before the fix the first new
    worker joined the old file and the second made a new one with the new scheduler: the two
    workers of one start mapped different memory."""
    roles = [_Role(private_shm, "wf", False)]
    try:
        roles.append(_Role(private_shm, "wf", True))
        roles[1].proc.kill()
        roles[1].proc.wait(30)
        new = [_Role(private_shm, "wf", False), _Role(private_shm, "wf", False), _Role(private_shm, "wf", True)]
        roles += new
        assert len({r.generation for r in new}) == 1 and new[0].generation != roles[0].generation
        new[2].ask("w 77")
        assert new[0].ask("r") == new[1].ask("r") == 77
    finally:
        for role in roles:
            role.stop()


def test_a_schedulers_failed_attach_does_not_mark_its_start_dead(private_shm: Path) -> None:
    """The scheduler's first attach failed in mmap (a transient memory shortfall, RLIMIT_AS) after
    it had marked the file scheduled; its retry took its own start for dead, unlinked the live
    worker's file and made another: the worker never saw the scheduler's bytes."""
    script = textwrap.dedent("""
        import resource, sys
        from kvtier.region import SharedRegion
        shm, name = sys.argv[1], sys.argv[2]
        vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), hard))
        try:
            SharedRegion(name, 4, 16 << 20, expected_mappers=3, shm_dir=shm, prefault=False, scheduler=True)
            print("attached at once")
        except BaseException as exc:
            print("first attach failed:", type(exc).__name__)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        region = SharedRegion(name, 4, 16 << 20, expected_mappers=3, shm_dir=shm, prefault=False, scheduler=True)
        print("creator" if region.is_creator else "joined", flush=True)
        region.rows[0, 0] = 55
        print("written", flush=True)
        sys.stdin.readline()
    """)
    worker = SharedRegion("fa", 4, 16 << 20, expected_mappers=3, shm_dir=private_shm, prefault=False)
    try:
        proc = subprocess.Popen([sys.executable, "-c", script, str(private_shm), "fa"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
        assert proc.stdout is not None and proc.stdin is not None
        first, joined, written = (proc.stdout.readline().strip() for _ in range(3))
        try:
            assert first == "first attach failed: OSError", first
            assert (joined, written) == ("joined", "written")  # before the fix: "creator" (a second file)
            assert int(worker.rows[0, 0]) == 55
        finally:
            proc.stdin.close()
            proc.wait(30)
    finally:
        worker.close()


def test_a_fork_does_not_inherit_a_dropped_regions_mapping(private_shm: Path) -> None:
    """A region dropped without close() while a view of its rows lived: its finalizer closed the
    descriptor, but the mapping lived on with the view, and a child forked then inherited it (and
    with it the start's locks: a killed engine's file looked alive to its restart)."""
    import gc

    region = SharedRegion("dropped", 2, 4096, expected_mappers=3, shm_dir=private_shm)
    inode = os.fstat(region._fd).st_ino
    view = region.rows
    view[0, 0] = 9
    del region
    gc.collect()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # (no pytest here: report through the pipe and leave at once)
        with open("/proc/self/maps") as maps:
            held = [line for line in maps if line.split()[4:5] == [str(inode)]]
        os.write(write, b"held" if held or int(view[0, 0]) != 0 else b"clean")
        os._exit(0)
    os.close(write)
    seen = os.read(read, 16)
    os.close(read)
    os.waitpid(child, 0)
    assert seen == b"clean"  # before the fix: b"held"
    assert int(view[0, 0]) == 9  # the parent's view is untouched
    del view
    gc.collect()


@pytest.mark.timeout(120)
def test_forks_never_wait_on_a_collected_regions_finalizer(private_shm: Path) -> None:
    """A thread holding logging's lock ran a dropped region's finalizer (garbage collection) that
    waited for the fork guard, held by a thread forking, which waited for logging's lock: a hang."""
    script = textwrap.dedent("""
        import gc, logging, os, sys, threading
        from kvtier.region import SharedRegion
        gc.set_threshold(50, 1, 1)
        stop = False
        def churn():
            i = 0
            while not stop:
                logging.getLogger(f"churn.{i % 5000}.{i}")
                i += 1
        threading.Thread(target=churn, daemon=True).start()
        logging.getLogger("kvtier").setLevel(logging.ERROR)
        for n in range(100):
            region = SharedRegion(f"fl-{n}", 1, 4096, shm_dir=sys.argv[1], prefault=False)
            region.self_ref = region  # a cycle: only the garbage collector finalizes it
            del region
            child = os.fork()
            if child == 0:
                os._exit(0)
            os.waitpid(child, 0)
        stop = True
        print("100 forks", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script, str(private_shm)], capture_output=True, text=True, env=ENV,
                          timeout=100)  # fmt: skip
    assert done.returncode == 0 and "100 forks" in done.stdout, done.stderr[-2000:]
