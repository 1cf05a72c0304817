"""Shared fixtures: namespaces, /dev/shm leak detection, private shm directories."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.keys import KVGeometry, Namespace
from kvtier.region import FILE_PREFIX, FILE_SUFFIX

SHM = Path("/dev/shm")

# --- parallel runs (pytest-xdist, ``--dist loadgroup``) -------------------------------------------
# Tests that use /dev/shm itself (leak checks of it, sweeps of it, processes holding a region there
# killed) run one at a time on one worker ("shm" group): another worker's test could otherwise
# see a file a killed process left a moment ago as a leak, or sweep it. vLLM engines run one at
# a time on one worker ("vllm"): two CPU engines side by side would only slow each other down.
# Everything else is spread over the workers test by test.
SHM_ROOT_FIXTURES = frozenset({"shm_leak_check"})
SHM_ROOT_MODULES = frozenset({
    # they kill (SIGKILL, os._exit) processes that may hold a region in /dev/shm, or sweep it
    "test_cli.py", "test_cli_inputs.py", "test_cli_replay_front_end.py", "test_manager_stateful.py",
    "test_plugins.py", "test_region.py", "test_region_hardening.py", "test_region_lifecycle_exit.py",
    "test_region_restart_races.py", "test_tempdir.py", "test_conformance.py", "test_fs_crash.py",
    "test_fs_share.py", "test_redis.py", "test_redis_manager.py", "test_s3.py", "test_hostile.py",
    "test_hostile_stream.py", "test_http.py", "test_redis_deletion.py", "test_writer_fencing.py",
})  # fmt: skip
MAX_WORKERS = 4
"""``-n auto`` starts at most this many workers: the two serial groups bound the run anyway."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per CPU this process may run on, at most :data:`MAX_WORKERS`."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give each test its xdist group (before xdist reads them: ``tryfirst``)."""
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.xdist_group("vllm"))
        elif item.path.name in SHM_ROOT_MODULES or SHM_ROOT_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("shm"))


def _region_files(directory: Path) -> set[Path]:
    return {p for p in directory.glob(f"*{FILE_PREFIX}*{FILE_SUFFIX}") if p.is_file()}


def _unheld(path: Path) -> bool:
    """True if no live process holds the region's liveness lock (a leak, not a neighbour)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def open_fds_under(path: Path) -> list[str]:
    """What this process has open below ``path`` (from /proc/self/fd): must be empty after a cleanup."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            out.append(target)
    return out


@pytest.fixture
def open_fds() -> Callable[[Path], list[str]]:
    """:func:`open_fds_under`, for tests in any folder."""
    return open_fds_under


@pytest.fixture
def namespace() -> Namespace:
    """A namespace with small 8 KiB blocks (two pages)."""
    return Namespace("test-model", KVGeometry.from_block_bytes(8192))


@pytest.fixture
def shm_leak_check() -> Iterator[None]:
    """Fails the test if it leaves a kvtier region file in /dev/shm that no live process holds.

    Files that appear meanwhile but are held by a live process (another test run or
    engine on this machine) are neighbours, not leaks, and are left alone.
    """
    before = _region_files(SHM)
    yield
    leaked = sorted(p for p in _region_files(SHM) - before if _unheld(p))
    for path in leaked:
        path.unlink(missing_ok=True)
    assert not leaked, f"test leaked /dev/shm files: {[p.name for p in leaked]}"


@pytest.fixture
def private_shm() -> Iterator[Path]:
    """A private directory in /dev/shm for regions; fails the test if one is left behind.

    Private so that other processes' regions in /dev/shm never make the check flaky.
    """
    path = Path(tempfile.mkdtemp(prefix="kvtier-test-", dir=SHM))
    try:
        yield path
        leaked = sorted(p.name for p in path.iterdir())
        assert not leaked, f"test leaked region files: {leaked}"
    finally:
        shutil.rmtree(path, ignore_errors=True)
