"""SharedRegion with real /dev/shm files and real processes (kill -9 included)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import InsufficientSpaceError, RegionBusyError, RegionError
from kvtier.region import PAGE_SIZE, SharedRegion, region_path

pytestmark = pytest.mark.usefixtures("shm_leak_check")

CHILD = textwrap.dedent(
    """
    import sys, time
    from kvtier.region import SharedRegion
    name, rows, expected, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    region = SharedRegion(name, rows, 4096, expected_mappers=expected)
    view = region.rows
    if mode == "write":
        view[1, :4] = [9, 8, 7, 6]
    print("ready", region.is_creator, region.unlinked, int(view[0, 0]), flush=True)
    sys.stdin.readline()            # wait until the test says go (or kills us)
    if mode == "close":
        del view
        region.close()
        print("closed", flush=True)
    """
)


def _unique() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


def _spawn(name: str, rows: int, expected: int, mode: str = "hold") -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, name, str(rows), str(expected), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc


def _wait_ready(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line and line[0] == "ready", f"child failed: {line}"
    return line


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def test_rows_are_page_aligned_and_strided() -> None:
    with SharedRegion(_unique(), 3, 5000) as region:
        rows = region.rows
        assert region.row_stride == 2 * PAGE_SIZE
        assert rows.shape == (3, region.row_stride)
        assert rows.ctypes.data % PAGE_SIZE == 0
        assert all(rows[i].ctypes.data % PAGE_SIZE == 0 for i in range(3))
        del rows


def test_file_mode_is_0600_and_path_unlinked_after_last_expected_mapper() -> None:
    name = _unique()
    first = SharedRegion(name, 2, 4096, expected_mappers=2)
    path = region_path(name)
    assert path.exists()
    assert (path.stat().st_mode & 0o777) == 0o600
    second = SharedRegion(name, 2, 4096, expected_mappers=2)
    assert first.is_creator and not second.is_creator
    assert not path.exists(), "path must be unlinked once every expected mapper attached"
    second.close()
    first.close()


def test_two_processes_share_bytes_and_path_goes_once_all_attached() -> None:
    name = _unique()
    path = region_path(name)
    child = _spawn(name, 4, 2, mode="write")
    try:
        _wait_ready(child)
        assert path.exists(), "one of two expected mappers attached: path must still exist"
        region = SharedRegion(name, 4, 4096, expected_mappers=2, create=False)
        assert not path.exists()
        rows = region.rows
        assert rows[1, :4].tolist() == [9, 8, 7, 6], "parent must see the child's bytes"
        rows[0, 0] = 42
        del rows
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        child.wait(timeout=10)
        region.close()
    finally:
        if child.poll() is None:
            _kill(child)


def test_child_sees_parent_bytes() -> None:
    name = _unique()
    region = SharedRegion(name, 2, 4096, expected_mappers=2)
    rows = region.rows
    rows[0, 0] = 77
    child = _spawn(name, 2, 2)
    try:
        line = _wait_ready(child)
        assert line[1:] == ["False", "True", "77"]
        assert not region_path(name).exists()
    finally:
        _kill(child)
        del rows
        region.close()


def test_kill_9_of_every_process_leaves_nothing() -> None:
    name = _unique()
    a = _spawn(name, 8, 2)
    b = _spawn(name, 8, 2)
    try:
        _wait_ready(a)
        _wait_ready(b)
    finally:
        _kill(a)
        _kill(b)
    assert not region_path(name).exists()


def test_sweep_removes_file_of_killed_process_but_never_a_live_one() -> None:
    dead_name, live_name = _unique(), _unique()
    dead = _spawn(dead_name, 2, 3)  # expects 3 mappers: dies inside the window before unlink
    live = _spawn(live_name, 2, 3)
    try:
        _wait_ready(dead)
        _wait_ready(live)
        _kill(dead)
        assert region_path(dead_name).exists()
        stale = SharedRegion.sweep_stale(remove=False)
        stale_paths = {s.path for s in stale}
        assert region_path(dead_name) in stale_paths
        assert region_path(live_name) not in stale_paths
        assert region_path(dead_name).exists(), "listing must not remove"
        removed = SharedRegion.sweep_stale(remove=True)
        assert any(s.path == region_path(dead_name) and s.removed for s in removed)
        assert not region_path(dead_name).exists()
        assert region_path(live_name).exists(), "a live process's file must never be touched"
    finally:
        _kill(live)
        if dead.poll() is None:
            _kill(dead)
    SharedRegion.sweep_stale(remove=True)
    assert not region_path(live_name).exists()


def test_more_than_shm_holds_is_a_clear_error_and_leaves_no_file() -> None:
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    name = _unique()
    rows = free // (1 << 20) + 16
    with pytest.raises(InsufficientSpaceError) as info:
        SharedRegion(name, rows, 1 << 20)
    message = str(info.value)
    assert "/dev/shm" in message and "free" in message and "needed" in message and "cpu_bytes" in message
    assert not region_path(name).exists()
    assert not list(Path("/dev/shm").glob(f"*{name}*"))


def test_attach_with_other_geometry_is_refused() -> None:
    name = _unique()
    with SharedRegion(name, 2, 4096, expected_mappers=2), pytest.raises(RegionError, match="same geometry"):
        SharedRegion(name, 3, 4096, expected_mappers=2, create=False)


def test_attach_only_times_out_clearly() -> None:
    with pytest.raises(RegionError, match="did not appear"):
        SharedRegion(_unique(), 2, 4096, create=False, attach_timeout=0.05)


def test_must_create_fails_when_taken() -> None:
    name = _unique()
    with SharedRegion(name, 2, 4096, expected_mappers=2), pytest.raises(RegionError, match="already exists"):
        SharedRegion(name, 2, 4096, create=True)


def test_close_with_live_view_fails_loudly_and_keeps_region_valid() -> None:
    region = SharedRegion(_unique(), 2, 4096)
    view = region.rows[1]
    view[:3] = [1, 2, 3]
    with pytest.raises(RegionBusyError, match="view"):
        region.close()
    assert not region.closed
    assert view[:3].tolist() == [1, 2, 3], "the mapping must stay valid after a refused close"
    assert region.rows[1, :3].tolist() == [1, 2, 3]
    del view
    region.close()
    assert region.closed
    region.close()  # idempotent
    with pytest.raises(RegionError, match="closed"):
        _ = region.rows


def test_bad_names_and_sizes() -> None:
    with pytest.raises(RegionError, match="name"):
        SharedRegion("../evil", 1, 4096)
    with pytest.raises(RegionError, match="num_rows"):
        SharedRegion(_unique(), 0, 4096)
    with pytest.raises(RegionError, match="expected_mappers"):
        SharedRegion(_unique(), 1, 4096, expected_mappers=0)


def test_prefault_populates_pages() -> None:
    region = SharedRegion(_unique(), 64, 64 * 1024, prefault=True)
    try:
        rows = region.rows
        assert int(np.count_nonzero(rows)) == 0
        del rows
    finally:
        region.close()


def test_concurrent_creators_elect_exactly_one() -> None:
    name = _unique()
    procs = [_spawn(name, 4, 4) for _ in range(3)]
    try:
        lines = [_wait_ready(p) for p in procs]
        creators = [line[1] for line in lines].count("True")
        assert creators == 1
        region = SharedRegion(name, 4, 4096, expected_mappers=4, create=False)
        assert not region_path(name).exists()
        region.close()
    finally:
        for p in procs:
            _kill(p)
