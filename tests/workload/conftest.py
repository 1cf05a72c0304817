"""Fixtures for the workload tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def private_shm() -> Iterator[Path]:
    """A private directory in /dev/shm for regions; fails the test if one is left behind.

    Private so that other processes' regions in /dev/shm (other test runs on the
    same machine) never make the leak check flaky.
    """
    path = Path(tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm"))
    try:
        yield path
        leaked = sorted(p.name for p in path.iterdir())
        assert not leaked, f"test leaked region files: {leaked}"
    finally:
        shutil.rmtree(path, ignore_errors=True)
