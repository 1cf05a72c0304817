"""Shared fixtures: namespaces, /dev/shm leak detection, private shm directories."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from held_pages import open_fds_under
from kvtier.keys import KVGeometry, Namespace
from kvtier.region import FILE_PREFIX, FILE_SUFFIX

SHM = Path("/dev/shm")

# --- parallel runs (pytest-xdist) ---------------------------------------------------------------
# The README's test command runs on ``-n auto`` workers. Tests that use /dev/shm itself (its leak
# check, sweeps of it, processes that may hold a region there killed) run one at a time on one
# worker (group "shm"): another worker's test could otherwise take a file a killed process left a
# moment ago for a leak, or sweep it. vLLM engines run one at a time on one worker ("vllm"): CPU
# engines side by side only slow each other down. Every other test goes to any free worker.
# (pytest 9 ignores xdist's own ``xdist_group`` marks, which rename node ids: the groups are the
# scheduler's, by module, below.)
SHM_GROUP = frozenset({
    "fleet/test_engine_events.py", "fleet/test_hostile.py", "fleet/test_hostile_stream.py", "fleet/test_http.py",
    "fleet/test_reconstruction.py", "fleet/test_redis_deletion.py", "fleet/test_writer_fencing.py",
    "test_admission_guard.py", "test_cli.py", "test_cli_bad_inputs.py", "test_cli_inputs.py",
    "test_cli_replay_front_end.py", "test_config.py", "test_learned_admission.py", "test_manager.py",
    "test_manager_admission.py", "test_manager_boundary.py", "test_manager_call_checks.py",
    "test_manager_job_log.py", "test_manager_loads_touch_tiers.py", "test_manager_logged_failures.py",
    "test_manager_lookup_counts.py",
    "test_manager_prefix.py", "test_manager_regressions.py", "test_manager_shutdown.py",
    "test_manager_shutdown_deadline.py", "test_manager_stateful.py", "test_manager_waits.py", "test_plugins.py",
    "test_primary.py", "test_readme.py", "test_region.py", "test_region_hardening.py",
    "test_region_lifecycle_exit.py", "test_region_restart_races.py", "test_tempdir.py",
    "tiers/test_conformance.py", "tiers/test_fs_crash.py", "tiers/test_fs_manager.py", "tiers/test_fs_share.py",
    "tiers/test_manager_waits_tiers.py", "tiers/test_redis.py", "tiers/test_redis_manager.py", "tiers/test_s3.py",
    "transfer/test_host_copies.py", "transfer/test_transfer_engine.py",
})  # fmt: skip
"""Test modules (below ``tests/``) of the "shm" group."""
MAX_WORKERS = 4
"""``-n auto`` starts at most this many workers: the two serial groups bound the run anyway."""
TESTS = Path(__file__).resolve().parent


def serial_group(module: str) -> str | None:
    """The group of a test module (its path below ``tests/``), or None: any worker, test by test."""
    if module.startswith("integrations/test_vllm_"):
        return "vllm"
    return "shm" if module in SHM_GROUP else None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per CPU this process may run on, at most :data:`MAX_WORKERS`."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scheduling by scope, where a scope is a test's group, or the test alone."""
    if config.getvalue("dist") == "each":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0].removeprefix("tests/")
            return serial_group(module) or nodeid

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that checks /dev/shm for leaks, or runs vLLM, must be in its group's module list."""
    for item in items:
        path = item.path.resolve()
        if not path.is_relative_to(TESTS):
            continue
        module = path.relative_to(TESTS).as_posix()
        if "shm_leak_check" in getattr(item, "fixturenames", ()) and serial_group(module) != "shm":
            raise pytest.UsageError(f"{module} uses shm_leak_check: add it to SHM_GROUP in tests/conftest.py")
        if item.get_closest_marker("vllm") is not None and serial_group(module) != "vllm":
            raise pytest.UsageError(f"{module} runs vLLM: name it integrations/test_vllm_*.py")


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
