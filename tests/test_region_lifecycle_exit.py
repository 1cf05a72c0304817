"""The region at process exit and across fork (review r1): a creator that exits without shutdown
leaves nothing in the shm directory, and a child forked from an engine neither keeps a killed
engine's start alive nor disturbs its parent. Real /dev/shm, real processes, kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier import Namespace, RequestContext, TieringManager
from kvtier.keys import KVGeometry
from kvtier.region import SharedRegion

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENGINE = textwrap.dedent("""
    import os, sys, time
    from kvtier import Namespace, TieringManager
    from kvtier.keys import KVGeometry
    ns = Namespace("exit-test", KVGeometry.from_block_bytes(8192))
    mgr = TieringManager.create(namespace=ns, num_cpu_blocks=4, region_name=sys.argv[2], shm_dir=sys.argv[1],
                                expected_mappers=2)
    how = sys.argv[3]
    if how == "exit":
        sys.exit(0)
    if how == "raise":
        raise RuntimeError("the engine failed to start")
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # a helper forked by the engine (a multiprocessing 'fork' pool, a plain fork)
        os.close(read)
        os.setsid()
        os.write(write, b"x")  # (the fork hooks ran before this line)
        time.sleep(60)
        os._exit(0)
    os.close(write)
    os.read(read, 1)
    print(child, flush=True)
    time.sleep(600)
""")


def _engine(shm: Path, name: str, how: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", ENGINE, str(shm), name, how], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": SRC})  # fmt: skip


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_a_creator_that_exits_without_shutdown_leaves_nothing(private_shm: Path, how: str) -> None:
    """Before the fix the region file stayed (its finalizer was off at exit) until the next
    create in that directory or a sweep removed it."""
    proc = _engine(private_shm, f"exit-{how}", how)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (0 if how == "exit" else 1), err
    assert sorted(p.name for p in private_shm.iterdir()) == []


def test_a_forked_child_does_not_keep_a_killed_engines_start_alive(private_shm: Path) -> None:
    """kill -9 of an engine that had forked a helper, then a restart under the same name: the
    helper inherited the file (its descriptors and its mapping, which hold the start's locks), so
    before the fix the restarted scheduler joined the dead start's file and its worker created a
    second region: the worker's writes never reached the scheduler (wrong bytes)."""
    old = _engine(private_shm, "eng", "fork")
    assert old.stdout is not None
    helper = int(old.stdout.readline())
    try:
        old.send_signal(signal.SIGKILL)
        old.wait(30)
        ns = Namespace("exit-test", KVGeometry.from_block_bytes(8192))
        mgr = TieringManager.create(namespace=ns, num_cpu_blocks=4, region_name="eng", shm_dir=private_shm,
                                    expected_mappers=2)  # fmt: skip
        try:
            assert mgr.region.is_creator  # the dead start's file replaced, not joined
            worker = SharedRegion("eng", 4, 8192, expected_mappers=2, shm_dir=private_shm, attach_timeout=5)
            try:
                assert not worker.is_creator
                req = RequestContext("r")
                result = mgr.prepare_store([b"K" * 32], req)
                assert result is not None
                slot = int(result.slots[0])
                rows = worker.rows
                rows[slot, :8192] = 0x5A
                del rows
                mgr.complete_store(result.keys_to_store, req)
                assert int(mgr.rows[slot, 100]) == 0x5A  # before the fix: 0 (two regions)
            finally:
                worker.close()
        finally:
            mgr.shutdown()
    finally:
        os.kill(helper, signal.SIGKILL)
    assert sorted(p.name for p in private_shm.iterdir()) == []


def test_a_forked_child_leaves_its_parents_region_alone(private_shm: Path) -> None:
    """The child's inherited rows no longer share the parent's memory (they read zeros); the
    parent's rows, mapping and file are untouched by the child's fork and exit."""
    region = SharedRegion("parent", 2, 4096, shm_dir=private_shm)
    try:
        rows = region.rows
        rows[0, :16] = 7
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # (no pytest in here: report through the pipe and leave at once)
            ok = int(rows[0, 0]) == 0 and region._fd_box[0] == -1
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
        os.close(write)
        seen = os.read(read, 1)
        os.close(read)
        os.waitpid(child, 0)
        assert seen == b"1"
        rows[0, 16] = 9
        assert int(rows[0, 0]) == 7 and int(region.rows[0, 16]) == 9
        del rows
    finally:
        region.close()
    assert sorted(p.name for p in private_shm.iterdir()) == []


def test_a_second_engine_under_a_live_engines_region_name_is_refused(private_shm: Path) -> None:
    """Review r1: with expected_mappers=2, a second manager under the same region name, before the
    first one's worker attached, joined the live file: both managers handed out the same rows
    (one's stores overwrote the other's), and its join unlinked the path, so the first engine's
    worker then created a second region. Now the second scheduler is refused and the first's
    worker still joins the first's region."""
    ns = Namespace("exit-test", KVGeometry.from_block_bytes(8192))
    first = TieringManager.create(namespace=ns, num_cpu_blocks=4, region_name="dup", shm_dir=private_shm,
                                  expected_mappers=2)  # fmt: skip
    try:
        with pytest.raises(Exception, match=r"scheduler maps it.*pick another name"):
            TieringManager.create(namespace=ns, num_cpu_blocks=4, region_name="dup", shm_dir=private_shm,
                                  expected_mappers=2)  # fmt: skip
        worker = SharedRegion("dup", 4, 8192, expected_mappers=2, shm_dir=private_shm, attach_timeout=5)
        try:
            assert not worker.is_creator and worker.unlinked
            rows = worker.rows
            rows[1, :8] = 0x33
            del rows
            assert int(first.rows[1, 0]) == 0x33
        finally:
            worker.close()
    finally:
        first.shutdown()
    assert sorted(p.name for p in private_shm.iterdir()) == []


def test_a_scheduler_joins_the_region_its_worker_created(private_shm: Path) -> None:
    """Whoever comes first creates (the worker may): the scheduler still joins it."""
    worker = SharedRegion("first", 4, 8192, expected_mappers=2, shm_dir=private_shm)
    try:
        ns = Namespace("exit-test", KVGeometry.from_block_bytes(8192))
        mgr = TieringManager.create(namespace=ns, num_cpu_blocks=4, region_name="first", shm_dir=private_shm,
                                    expected_mappers=2)  # fmt: skip
        try:
            assert worker.is_creator and not mgr.region.is_creator
        finally:
            mgr.shutdown()
    finally:
        worker.close()
