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
from typing import Any

import pytest

from kvtier import Namespace, RequestContext, TieringManager
from kvtier.errors import RegionError
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


def _one_mapping(writer: Any, reader: Any, row: int, value: int) -> bool:
    """A write into ``writer``'s rows shows in ``reader``'s: they map one region."""
    rows = writer.rows
    rows[row, :8] = value
    del rows
    return int(reader.rows[row, 7]) == value


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
            assert _one_mapping(worker, first, 1, 0x33)
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


def test_a_scheduler_restarted_while_its_old_workers_live_starts_a_new_region(private_shm: Path) -> None:
    """Review r2: the worker created the region, the scheduler joined it and was killed -9 while
    the worker lived on (exiting): the restarted scheduler joined the old start's file (its creator
    alive) and completed its attach count, so the new start's worker created a second file: two
    mappings, wrong bytes. A file whose scheduler is gone belongs to a dead start: replaced."""
    script = textwrap.dedent("""
        import sys, time
        from kvtier.region import SharedRegion
        region = SharedRegion("restart", 8, 4096, expected_mappers=3, shm_dir=sys.argv[1],
                              scheduler=sys.argv[2] == "scheduler")
        print(region.generation.hex(), flush=True)
        time.sleep(120)
    """)
    env = {**os.environ, "PYTHONPATH": SRC}
    procs = []
    try:
        lines = []
        for role in ("worker", "scheduler"):  # the worker creates, then the scheduler joins
            procs.append(subprocess.Popen([sys.executable, "-c", script, str(private_shm), role],
                                          stdout=subprocess.PIPE, text=True, env=env))  # fmt: skip
            out = procs[-1].stdout
            assert out is not None
            lines.append(out.readline().strip())
        old_scheduler = procs[1]
        old = lines[0]
        assert lines[1] == old  # one start: the scheduler joined the worker's file
        old_scheduler.send_signal(signal.SIGKILL)
        old_scheduler.wait(30)
        scheduler = SharedRegion("restart", 8, 4096, expected_mappers=3, shm_dir=private_shm, scheduler=True)
        try:
            assert scheduler.is_creator and scheduler.generation is not None
            assert scheduler.generation.hex() != old  # before the fix: it joined the old start
            worker = SharedRegion("restart", 8, 4096, expected_mappers=3, shm_dir=private_shm, attach_timeout=5)
            try:
                assert worker.generation == scheduler.generation
                assert _one_mapping(worker, scheduler, 2, 0x61)
            finally:
                worker.close()
        finally:
            scheduler.close()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def test_forks_while_another_thread_makes_and_closes_regions_leave_the_child_nothing(private_shm: Path) -> None:
    """Review r2: a fork while another thread was between opening a region's file and recording
    its descriptor, or midway through closing it, left the child holding the file (and the
    start's locks), or made the child's fork hook close a descriptor number the parent had just
    reused for something else."""
    import threading

    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            SharedRegion(f"churn-{i}", 4, 4096, expected_mappers=2, shm_dir=private_shm, prefault=False).close()
            i += 1

    thread = threading.Thread(target=churn)
    thread.start()
    bad = []
    try:
        for _ in range(300):
            probe = os.open(os.devnull, os.O_RDONLY)  # a descriptor of the parent's own, open across the fork
            read, write = os.pipe()
            child = os.fork()
            if child == 0:
                held = []
                for name in os.listdir("/proc/self/fd"):
                    try:
                        target = os.readlink(f"/proc/self/fd/{name}")
                    except OSError:
                        continue
                    # (a region's file or lock; not any path with "kvtier-" in it: the CI clone's own
                    # log, /work/kvtier-ci/LOG, is a worker's standard output)
                    if str(private_shm) in target or target.startswith(("/dev/shm/kvtier-", "/dev/shm/#")):
                        held.append(target)
                with open("/proc/self/maps") as maps:
                    held += [line for line in maps if str(private_shm) in line or "/dev/shm/#" in line]
                try:
                    os.fstat(probe)
                except OSError:
                    held.append("the parent's unrelated descriptor was closed")
                os.write(write, repr(held).encode()[:4000])
                os._exit(0)
            os.close(write)
            seen = os.read(read, 4096).decode()
            os.close(read)
            os.waitpid(child, 0)
            os.close(probe)
            if seen != "[]":
                bad.append(seen)
    finally:
        stop.set()
        thread.join(30)
    assert not bad, bad[:3]


def _manager(shm: Path, name: str, mappers: int = 2) -> TieringManager:
    ns = Namespace("exit-test", KVGeometry.from_block_bytes(8192))
    return TieringManager.create(namespace=ns, num_cpu_blocks=4, region_name=name, shm_dir=shm,
                                 expected_mappers=mappers)  # fmt: skip


def test_a_worker_never_takes_the_place_kept_for_its_scheduler(private_shm: Path) -> None:
    """Regression (review, 2026-12-05): with one worker too many (expected_mappers too low), the
    second worker completed the start and unlinked its path; the scheduler then made a second file,
    and the engine's worker and scheduler copied to and read from different rows (wrong bytes,
    persisted to the fs tier). The last place is the scheduler's: the extra worker is refused."""
    first = SharedRegion("split", 4, 8192, expected_mappers=2, shm_dir=private_shm, worker=True)
    try:
        with pytest.raises(RegionError, match="last place is its scheduler's"):
            SharedRegion("split", 4, 8192, expected_mappers=2, shm_dir=private_shm, worker=True)
        mgr = _manager(private_shm, "split")
        try:
            assert _one_mapping(first, mgr.region, 1, 42) and first.start_complete()
            assert list(private_shm.iterdir()) == [], "the start is complete: its path is unlinked"
        finally:
            mgr.shutdown()
    finally:
        first.close()
    # Scheduler first, then the worker: it completes the start as before.
    mgr = _manager(private_shm, "split")
    try:
        worker = SharedRegion("split", 4, 8192, expected_mappers=2, shm_dir=private_shm, worker=True)
        try:
            assert _one_mapping(worker, mgr.region, 2, 7) and worker.start_complete()
        finally:
            worker.close()
    finally:
        mgr.shutdown()


def test_a_worker_that_came_after_its_start_completed_copies_nothing(private_shm: Path) -> None:
    """Regression (review, 2026-12-05): a worker started after its engine's start was complete (the
    path unlinked) made a file of its own and copied into rows no scheduler reads. Its copier now
    refuses every copy; the engine recomputes instead of loading bytes that were never stored."""
    import numpy as np
    import torch

    from kvtier.errors import KvtierError
    from kvtier.integrations.vllm.copier import RegionCopier

    def copier() -> RegionCopier:
        dev = torch.zeros(4, 256, dtype=torch.int8)
        return RegionCopier(region_name="late", shm_dir=str(private_shm), num_rows=4, row_bytes=8192,
                            expected_mappers=2, rank=0, rank_bytes=4096, blocks_per_chunk=1, device_tensors=[dev],
                            group_refs=[[(0, 256)]])  # fmt: skip

    mgr = _manager(private_shm, "late")
    try:
        on_time = copier()
        late = None
        try:
            on_time.submit(1, np.array([0]), [1], [0], np.array([1]), to_device=False)
            on_time.engine.wait([1], timeout=10)
            late = copier()  # the path is gone: it makes a file no scheduler will join
            assert not late.region.start_complete()
            with pytest.raises(KvtierError, match="not mapped by all 2 processes"):
                late.submit(2, np.array([0]), [1], [0], np.array([1]), to_device=False)
        finally:
            on_time.close()
            if late is not None:
                late.close()
    finally:
        mgr.shutdown()
    assert list(private_shm.iterdir()) == []
