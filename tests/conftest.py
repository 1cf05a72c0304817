"""Shared fixtures: namespaces, an isolated shm directory check, and leak detection."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.keys import KVGeometry, Namespace
from kvtier.region import FILE_PREFIX

SHM = Path("/dev/shm")


def _kvtier_shm_files() -> set[str]:
    return {p.name for p in SHM.glob(f"*{FILE_PREFIX}*")} if SHM.is_dir() else set()


@pytest.fixture
def namespace() -> Namespace:
    """A namespace with small 8 KiB blocks (two pages)."""
    return Namespace("test-model", KVGeometry.from_block_bytes(8192))


@pytest.fixture
def shm_leak_check() -> Iterator[None]:
    """Fails the test if it leaves a kvtier file behind in /dev/shm."""
    before = _kvtier_shm_files()
    yield
    leaked = _kvtier_shm_files() - before
    for name in leaked:
        os.unlink(SHM / name)
    assert not leaked, f"test leaked /dev/shm files: {sorted(leaked)}"
