"""Races between engines sharing an fs root, made deterministic (audit of 2026-12-05): a store's
link that finds its name taken by another engine's value which that engine evicts or recycles
before the store looks, and a shard directory swapped for a link or a file while an engine runs.
Real files and two real tiers on one root; the race is staged by a hook around the link."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from fs_helpers import AlignedRows, block_bytes_for, fill, key_of, load, make_tier, store

from kvtier.errors import ConfigError
from kvtier.tiers import fs as fs_module
from kvtier.tiers.base import HealthState
from kvtier.tiers.fs import FilesystemTier
from kvtier.tiers.fs_layout import entry_bytes, value_path
from kvtier.types import LookupResult

BB = 16 * 1024
ENTRY = entry_bytes(BB)


@pytest.fixture
def rows() -> Iterator[np.ndarray]:
    yield AlignedRows(16, BB).rows


class _Peer:
    """Another engine on the root whose value of ``key`` takes the name (:meth:`take`) and then
    leaves it (:meth:`leave`: it stores a fresh key, which makes it evict or recycle that value;
    its budget holds 2 files, the storing engine's claim one)."""

    def __init__(self, tier: FilesystemTier, rows: np.ndarray, key: bytes) -> None:
        self.tier, self.rows, self.key = tier, rows, key
        self.fillers = (key_of(i, b"peer-filler") for i in range(1_000))

    def take(self) -> None:
        fill(self.rows, [0], [self.key], BB)
        assert store(self.tier, [self.key], [0]).success
        assert value_path(self.tier.ns_dir, self.key).is_file()

    def leave(self) -> None:
        filler = next(self.fillers)
        fill(self.rows, [1], [filler], BB)
        assert store(self.tier, [filler], [1]).success
        assert not os.path.lexists(value_path(self.tier.ns_dir, self.key)), "the peer evicted or recycled it"


def _hook_links(
    monkeypatch: pytest.MonkeyPatch, before: list[Callable[[], None]], after: list[Callable[[], None]]
) -> list[int]:
    """Around the tier's next ``len(before)`` links of a temp file to its value name: run
    ``before[i]`` just before the i-th link and ``after[i]`` just after it (in the storing
    thread); other links (the peer's) pass. Returns what each hooked link answered (placed?)."""
    real = fs_module.place_value
    answers: list[bool] = []
    state = {"hooked": 0, "busy": False}

    def hooked(tmp_fd: int, tmp_name: str, dir_fd: int, name: str, *, hard_link: bool) -> bool:
        if state["hooked"] >= len(before) or state["busy"]:
            return real(tmp_fd, tmp_name, dir_fd, name, hard_link=hard_link)
        i = state["hooked"]
        state["hooked"], state["busy"] = i + 1, True
        try:
            before[i]()
            placed = real(tmp_fd, tmp_name, dir_fd, name, hard_link=hard_link)
            answers.append(placed)
            after[i]()
        finally:
            state["busy"] = False
        return placed

    monkeypatch.setattr(fs_module, "place_value", hooked)
    return answers


@pytest.fixture
def pair(tmp_path: Path, rows: np.ndarray) -> Iterator[tuple[FilesystemTier, FilesystemTier, np.ndarray]]:
    """This engine (a roomy budget) and a peer on the same root (a 2-file budget), started in that order."""
    tier = make_tier(tmp_path / "root", rows, BB, max_bytes=64 * ENTRY)
    peer_rows = AlignedRows(4, BB).rows
    peer = make_tier(tmp_path / "root", peer_rows, BB, max_bytes=2 * ENTRY)
    try:
        yield tier, peer, peer_rows
    finally:
        peer.shutdown()
        tier.shutdown()


def test_a_name_taken_at_the_link_and_free_when_looked_at_is_linked_again(
    pair: tuple[FilesystemTier, FilesystemTier, np.ndarray], rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (audit, 2026-12-05): the link failed (EEXIST: the peer's value of the key was
    there), the peer evicted or recycled it before the store looked, and the store failed as
    "a name taken by an entry that is not a value of ours", counted in unsafe_entries."""
    tier, peer_tier, peer_rows = pair
    key = key_of(1, b"race")
    peer = _Peer(peer_tier, peer_rows, key)
    answers = _hook_links(monkeypatch, [peer.take], [peer.leave])
    fill(rows, [0], [key], BB)
    result = store(tier, [key], [0])
    assert result.success, result.error
    assert answers == [False], "the first link found the name taken"
    extra = tier.stats.extra
    assert extra["unsafe_entries"] == 0 and extra["io_errors"] == 0 and extra["stores_skipped"] == 0
    assert tier.stats.stores_failed == 0 and tier.stats.bytes_written == BB, "linked on the second try"
    assert value_path(tier.ns_dir, key).is_file() and tier.lookup(key, None) is LookupResult.HIT
    rows[5] = 0
    assert load(tier, [key], [5]).success
    assert np.array_equal(rows[5, :BB], block_bytes_for(key, BB))
    assert not list((tier.ns_dir / "tmp").rglob("*.tmp")), "no temp file left behind"


def test_a_name_lost_twice_to_values_that_left_is_a_dropped_store_not_an_unsafe_entry(
    pair: tuple[FilesystemTier, FilesystemTier, np.ndarray], rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taken at both links and free both times it was looked at: the store lost a race (dropped,
    nothing written, the key not claimed), not a failure and not an unsafe entry."""
    tier, peer_tier, peer_rows = pair
    key = key_of(2, b"race")
    peer = _Peer(peer_tier, peer_rows, key)
    answers = _hook_links(monkeypatch, [peer.take, peer.take], [peer.leave, peer.leave])
    fill(rows, [0], [key], BB)
    result = store(tier, [key], [0])
    assert not result.success and "lost a race" in (result.error or ""), result.error
    assert answers == [False, False], "linked once more, and only once"
    extra = tier.stats.extra
    assert extra["unsafe_entries"] == 0 and extra["io_errors"] == 0
    assert tier.stats.stores_failed == 0 and tier.stats.stores_dropped == 1
    assert tier.lookup(key, None) is LookupResult.MISS
    assert tier.health().state is HealthState.CLOSED
    assert not list((tier.ns_dir / "tmp").rglob("*.tmp")), "no temp file left behind"
    fill(rows, [1], [key], BB)
    assert store(tier, [key], [1]).success, "the key is not left reserved"


def test_an_entry_planted_at_the_name_before_the_second_link_is_unsafe_and_left_alone(
    pair: tuple[FilesystemTier, FilesystemTier, np.ndarray],
    rows: np.ndarray,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The second link never replaces: a symlink planted at the name once the peer's value left
    is reported unsafe (the store fails), never followed, never removed."""
    tier, peer_tier, peer_rows = pair
    key = key_of(3, b"race")
    peer = _Peer(peer_tier, peer_rows, key)
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    link = value_path(tier.ns_dir, key)
    answers = _hook_links(
        monkeypatch,
        [peer.take, lambda: link.symlink_to(target)],
        [peer.leave, lambda: None],
    )
    fill(rows, [0], [key], BB)
    result = store(tier, [key], [0])
    assert not result.success and "not a value of ours" in (result.error or ""), result.error
    assert answers == [False, False]
    assert tier.stats.extra["unsafe_entries"] == 1 and tier.stats.extra["io_errors"] == 0
    assert link.is_symlink() and target.read_bytes() == b"keep"
    assert tier.lookup(key, None) is LookupResult.MISS


# --- shards that are not directories ---------------------------------------------------------------


def _swap_shard(shard: Path, swap: str, tmp_path: Path) -> Path:
    """Replace ``shard`` by a symlink to a directory outside the root holding a file named like a
    value, or by a FIFO; returns what must stay untouched (that directory, or the FIFO)."""
    shutil.rmtree(shard)
    if swap == "symlink":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "bait.kv").write_bytes(b"b" * 100)
        shard.symlink_to(elsewhere)
        return elsewhere
    os.mkfifo(shard)  # (a regular file there is the medium failing: see NamespaceDir.shard)
    return shard


def _keys_outside(shard: str, n: int, tag: bytes) -> list[bytes]:
    return [k for k in (key_of(i, tag) for i in range(4 * n + 64)) if f"{k[0]:02x}" != shard][:n]


@pytest.mark.parametrize("swap", ["symlink", "fifo"])
def test_a_shard_swapped_while_running_is_skipped_by_evictions_search_not_an_io_error(
    tmp_path: Path, rows: np.ndarray, swap: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (audit, 2026-12-05): a store that had to look for files to evict listed every
    shard, and one that was a symlink or a file failed the store as an I/O error ("write of ...
    failed: Not a directory"), counted in io_errors and against the breaker."""
    root = tmp_path / "root"
    tier = make_tier(root, rows, BB, max_bytes=4 * ENTRY, sharing=False)  # learns nothing the other writes
    try:
        swapped = "7f"
        other_rows = AlignedRows(4, BB).rows
        other = make_tier(root, other_rows, BB, max_bytes=4 * ENTRY)
        try:
            theirs = _keys_outside(swapped, 4, b"theirs")
            fill(other_rows, range(4), theirs, BB)
            assert store(other, theirs, range(4)).success
        finally:
            other.shutdown()
        untouched = _swap_shard(tier.ns_dir / swapped, swap, tmp_path)
        mine = _keys_outside(swapped, 6, b"mine")
        fill(rows, range(6), mine, BB)
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.fs"):
            for i, key in enumerate(mine):  # each needs room: the first finds the other's files by listing
                result = store(tier, [key], [i])
                assert result.success, result.error
        extra = tier.stats.extra
        assert extra["io_errors"] == 0 and extra["unsafe_entries"] >= 1
        assert tier.stats.evictions >= 2 and tier.health().state is HealthState.CLOSED
        logged = [r for r in caplog.records if f"shard {swapped} skipped" in r.getMessage()]
        assert len(logged) == 1, "logged once"
    finally:
        tier.shutdown()
    if swap == "symlink":
        assert (tier.ns_dir / swapped).is_symlink() and sorted(p.name for p in untouched.iterdir()) == ["bait.kv"]
        assert (untouched / "bait.kv").read_bytes() == b"b" * 100
    else:
        assert stat.S_ISFIFO(os.lstat(untouched).st_mode), "the FIFO is left where it was, never opened"


def test_a_shard_swapped_during_the_start_is_skipped_by_the_scan_and_one_swapped_before_refuses_it(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard that is a link when an engine starts refuses the start (as before); one swapped
    after the namespace was adopted, before the scan lists it, is skipped as unsafe: the other
    shards are indexed (it used to fail the start, or the whole scan)."""
    root = tmp_path / "root"
    keys = _keys_outside("7f", 4, b"scan")
    fill(rows, range(4), keys, BB)
    first = make_tier(root, rows, BB)
    try:
        assert store(first, keys, range(4)).success
    finally:
        first.shutdown()
    shard = first.ns_dir / "7f"
    elsewhere = tmp_path / "elsewhere"
    shard.rename(elsewhere)
    shard.symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="not a directory"):
        make_tier(root, rows, BB)
    shard.unlink()
    elsewhere.rename(shard)

    real_sweep = fs_module.sweep_temp_dirs

    def swap_then_sweep(dirs: object) -> tuple[int, int]:  # runs after every shard was adopted
        shard.rename(elsewhere)
        shard.symlink_to(elsewhere)
        return real_sweep(dirs)  # type: ignore[arg-type]

    monkeypatch.setattr(fs_module, "sweep_temp_dirs", swap_then_sweep)
    tier = make_tier(root, rows, BB)
    try:
        assert tier.scan_complete
        assert all(tier.lookup(key, None) is LookupResult.HIT for key in keys)
        assert tier.stats.extra["unsafe_entries"] >= 1 and tier.stats.extra["io_errors"] == 0
    finally:
        tier.shutdown()
    assert shard.is_symlink() and elsewhere.is_dir()
