"""TieringManager.create failing (issue 9, item 4): everything it made is released at once,
even while the caller keeps the exception (and so its traceback) alive."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from held_pages import mappings_under, pages_held_under
from kvtier import ConfigError, KVGeometry, Namespace, TieringManager
from kvtier.tiers.registry import register_tier

register_tier("scripted", "tier_doubles:ScriptedTier")
NS = Namespace("construction", KVGeometry.from_block_bytes(1 << 20))
REGION_BLOCKS = 64  # 64 MiB per attempt


@pytest.mark.parametrize(
    "tiers",
    [
        [{"type": "scripted"}, {"type": "scripted", "construct_error": ConfigError("bucket unreachable")}],
        [{"type": "fs", "root": "/proc/kvtier-cannot-be-here"}],
    ],
    ids=["tier-constructor-raises", "fs-root-unusable"],
)
def test_failed_creates_return_the_memory_fds_and_mappings(
    private_shm: Path, tiers: list[dict], caplog: pytest.LogCaptureFixture, open_fds: Callable[[Path], list[str]]
) -> None:
    """Three failed 64 MiB creates used to keep 192 MiB of /dev/shm mapped (path unlinked, fd and
    mapping alive, invisible to ls and sweep-shm) for as long as the exceptions lived."""
    kept: list[BaseException] = []
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with pytest.raises(ConfigError) as info:
                TieringManager.create(namespace=NS, num_cpu_blocks=REGION_BLOCKS, shm_dir=private_shm, tiers=tiers)
            kept.append(info.value)  # the caller keeps the exception and its traceback
    assert all(e.__traceback__ is not None for e in kept)
    assert open_fds(private_shm) == [] and mappings_under(private_shm) == []
    assert pages_held_under(private_shm) == [], "the failed regions' memory is still held"
    alarming = [r.getMessage() for r in caplog.records if r.name.startswith("kvtier") and r.levelno >= logging.WARNING]
    assert alarming == [], "a cleanup that succeeded says nothing alarming"


def test_bad_options_are_refused_before_anything_is_created(
    private_shm: Path, open_fds: Callable[[Path], list[str]]
) -> None:
    for kwargs in (
        {"policy": "no-such-policy"},
        {"tiers": [{"type": "fs", "root": str(private_shm), "read_threads": 0}]},
        {"tiers": [{"type": "no-such-tier"}]},
        {"shutdown_timeout": -5},
    ):
        with pytest.raises(ConfigError):
            TieringManager.create(namespace=NS, num_cpu_blocks=REGION_BLOCKS, shm_dir=private_shm, **kwargs)
        assert not list(private_shm.iterdir()) and open_fds(private_shm) == []
