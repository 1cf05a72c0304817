"""The filesystem tier against real files: round trips, warm restart, corruption, capacity,
ENOSPC and health on real (tmpfs) file systems, temp sweeping, shutdown, offline verify."""

from __future__ import annotations

import errno
import fcntl
import gc
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fs_helpers import (
    AlignedRows,
    block_bytes_for,
    dir_bytes,
    fill,
    key_of,
    load,
    make_tier,
    mount_tmpfs,
    store,
    store_three,
    temp_files,
    value_files,
)

from kvtier.errors import ConfigError, TierError
from kvtier.tiers.base import HealthState, TransferJob
from kvtier.tiers.fs import FilesystemTier, verify_root
from kvtier.tiers.fs_index import FileIndex, Reservation
from kvtier.tiers.fs_layout import PAYLOAD_OFFSET, entry_bytes, value_path
from kvtier.tiers.registry import create_tier
from kvtier.types import LookupResult

BB = 64 * 1024
ENTRY = entry_bytes(BB)


@pytest.fixture
def rows() -> np.ndarray:
    return AlignedRows(32, BB).rows


def _mount_tmpfs(where: Path, size: str) -> None:
    why = mount_tmpfs(where, size)
    if why is not None:
        pytest.skip(f"cannot mount a tmpfs here ({why}); the test needs root or CAP_SYS_ADMIN")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs, unmounted afterwards."""
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "8m")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _check_rows(rows: np.ndarray, slots: list[int], keys: list[bytes], n: int = BB) -> None:
    for slot, key in zip(slots, keys, strict=True):
        assert np.array_equal(rows[slot, :n], block_bytes_for(key, n)), f"slot {slot} differs"


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("direct_io", [True, False])
def test_round_trip_is_byte_exact(tmp_path: Path, rows: np.ndarray, direct_io: bool) -> None:
    tier = make_tier(tmp_path, rows, BB, direct_io=direct_io)
    try:
        assert tier.direct_io is direct_io
        keys = [key_of(i) for i in range(8)]
        fill(rows, range(8), keys, BB)
        result = store(tier, keys, list(range(8)))
        assert result.success and result.bytes_moved == 8 * BB
        rows[8:16] = 0
        result = load(tier, keys, list(range(8, 16)))
        assert result.success and result.bytes_moved == 8 * BB
        _check_rows(rows, list(range(8, 16)), keys)
        assert all(tier.lookup(k, None) is LookupResult.HIT for k in keys)
        assert tier.lookup(key_of(999), None) is LookupResult.MISS
        assert tier.usage().used_bytes == 8 * ENTRY and tier.usage().entries == 8
        assert tier.stats.bytes_written == tier.stats.bytes_read == 8 * BB
        assert len(value_files(tmp_path)) == 8
        stored = [e for e in tier.take_events() if not e.removed]
        assert {k for e in stored for k in e.keys} == set(keys)
        assert all(e.tier == "0:fs" and e.medium == "disk" for e in stored)
    finally:
        tier.shutdown()


def test_block_size_not_a_page_multiple(tmp_path: Path) -> None:
    bb = 3 * 4096 + 112
    rows = AlignedRows(4, bb).rows
    tier = make_tier(tmp_path, rows, bb)
    try:
        keys = [key_of(i) for i in range(2)]
        fill(rows, [0, 1], keys, bb)
        assert store(tier, keys, [0, 1]).success
        rows[2:4] = 0
        assert load(tier, keys, [2, 3]).success
        _check_rows(rows, [2, 3], keys, bb)
    finally:
        tier.shutdown()


def test_created_through_registry(tmp_path: Path, rows: np.ndarray) -> None:
    from fs_helpers import namespace

    from kvtier.tiers.base import TierContext

    ctx = TierContext(rows=rows, block_bytes=BB, namespace=namespace(BB), index=2)
    tier = create_tier({"type": "fs", "root": str(tmp_path), "max_bytes": 10 * ENTRY}, ctx)
    try:
        assert isinstance(tier, FilesystemTier) and tier.label == "2:fs"
        assert tier.usage().capacity_bytes == 10 * ENTRY
        desc = tier.describe()
        assert desc["type"] == "fs" and desc["root"] == str(tmp_path) and desc["max_bytes"] == 10 * ENTRY
    finally:
        tier.shutdown()
    with pytest.raises(ConfigError, match="bad options"):
        create_tier({"type": "fs", "root": str(tmp_path), "no_such_option": 1}, ctx)


def test_present_keys_are_skipped(tmp_path: Path, rows: np.ndarray) -> None:
    tier = make_tier(tmp_path, rows, BB)
    try:
        keys = [key_of(i) for i in range(3)]
        fill(rows, range(3), keys, BB)
        assert store(tier, keys, [0, 1, 2]).success
        inodes = {p.name: p.stat().st_ino for p in value_files(tmp_path)}
        rows[0:3] = 7  # would be wrong data if rewritten
        result = store(tier, keys, [0, 1, 2])
        assert result.success and result.bytes_moved == 0
        assert tier.stats.extra["stores_skipped"] == 3
        assert {p.name: p.stat().st_ino for p in value_files(tmp_path)} == inodes
        assert load(tier, keys, [3, 4, 5]).success
        _check_rows(rows, [3, 4, 5], keys)
    finally:
        tier.shutdown()


def test_load_of_unknown_key_fails_only_that_key(tmp_path: Path, rows: np.ndarray) -> None:
    tier = make_tier(tmp_path, rows, BB)
    try:
        good = key_of(1)
        fill(rows, [0], [good], BB)
        assert store(tier, [good], [0]).success
        result = load(tier, [good, key_of(2)], [1, 2])
        assert not result.success and result.successful_keys == frozenset([good])
        assert tier.stats.loads_failed == 1
        _check_rows(rows, [1], [good])
    finally:
        tier.shutdown()


# --- warm restart and namespaces --------------------------------------------------------------


def test_warm_restart_hits_same_namespace_only(tmp_path: Path, rows: np.ndarray) -> None:
    keys = [key_of(i) for i in range(6)]
    fill(rows, range(6), keys, BB)
    first = make_tier(tmp_path, rows, BB)
    assert store(first, keys, list(range(6))).success
    first.shutdown()

    again = make_tier(tmp_path, rows, BB)
    try:
        assert all(again.lookup(k, None) is LookupResult.HIT for k in keys)
        assert again.usage().entries == 6
        rows[6:12] = 0
        assert load(again, keys, list(range(6, 12))).success
        _check_rows(rows, list(range(6, 12)), keys)
    finally:
        again.shutdown()

    other = make_tier(tmp_path, rows, BB, model_id="another/model")
    try:
        assert other.ns_dir != again.ns_dir
        assert all(other.lookup(k, None) is LookupResult.MISS for k in keys)
        assert other.usage().entries == 0
        mine = [key_of(100)]
        fill(rows, [0], mine, BB)
        assert store(other, mine, [0]).success
    finally:
        other.shutdown()
    # The first namespace's files are untouched by the other engine.
    assert len(list(again.ns_dir.rglob("*.kv"))) == 6


def test_background_scan_answers_retry_until_known(tmp_path: Path, rows: np.ndarray) -> None:
    keys = [key_of(i) for i in range(200)]
    tier = make_tier(tmp_path, rows, BB)
    for start in range(0, 200, 20):
        fill(rows, range(20), keys[start : start + 20], BB)
        assert store(tier, keys[start : start + 20], list(range(20))).success
    tier.shutdown()

    again = make_tier(tmp_path, rows, BB, scan_in_background=True)
    try:
        answers: set[LookupResult] = set()
        deadline = time.monotonic() + 20
        while not again.scan_complete and time.monotonic() < deadline:
            answers.update(again.lookup(k, None) for k in keys)
        assert again.scan_complete
        assert answers <= {LookupResult.HIT, LookupResult.RETRY}
        assert all(again.lookup(k, None) is LookupResult.HIT for k in keys)
        assert again.lookup(key_of(10_000), None) is LookupResult.MISS
        assert again.stats.extra["scan_entries"] == 200
    finally:
        again.shutdown()


def test_lookup_racing_the_scan_answers_retry_not_miss(tmp_path: Path, rows: np.ndarray) -> None:
    """Regression: a lookup that missed the index just before the scanner added the key's
    shard (and flagged it scanned) used to answer MISS."""
    key = key_of(7)
    fill(rows, [0], [key], BB)
    tier = make_tier(tmp_path, rows, BB)
    try:
        assert store(tier, [key], [0]).success
        # Rewind to "shard of key not scanned yet" (the key never indexed; not deleted, which the
        # index would remember) and let the scan land inside lookup.
        with tier._index._lock:
            assert tier._index._used.pop(key, None) is not None
            tier._index._seen.pop(key, None)
        tier._scanned[key[0]] = 0
        real_hit = tier._index.hit

        def hit_then_scan(k: bytes) -> bool:
            found = real_hit(k)
            tier._index.add_found([(0.0, k)])
            tier._scanned[k[0]] = 1
            return found

        tier._index.hit = hit_then_scan  # type: ignore[method-assign]
        assert tier.lookup(key, None) is LookupResult.RETRY
        tier._index.hit = real_hit  # type: ignore[method-assign]
        assert tier.lookup(key, None) is LookupResult.HIT
    finally:
        tier.shutdown()


@pytest.mark.slow
def test_scan_of_100k_entries_does_not_hold_up_start(tmp_path: Path, rows: np.ndarray) -> None:
    # On a tmpfs when possible: creating 100k files on the virtual disk takes ~30 s.
    where = tmp_path / "many"
    where.mkdir()
    mounted = (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], capture_output=True).returncode
        == 0
    )
    try:
        _scan_100k(where, rows)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)], check=False)


def _scan_100k(tmp_path: Path, rows: np.ndarray) -> None:
    first = make_tier(tmp_path, rows, BB)
    ns_dir = first.ns_dir
    first.shutdown()
    keys = [key_of(i) for i in range(100_000)]
    for key in keys:  # names only: the scan never reads contents
        os.close(os.open(value_path(ns_dir, key), os.O_CREAT | os.O_WRONLY, 0o644))
    t0 = time.perf_counter()
    tier = make_tier(tmp_path, rows, BB, scan_in_background=True, max_bytes=200_000 * ENTRY)
    started = time.perf_counter() - t0
    try:
        assert started < 1.0, f"constructor took {started:.2f}s with 100k files"
        early = tier.lookup(keys[-1], None)
        assert early in (LookupResult.HIT, LookupResult.RETRY)
        deadline = time.monotonic() + 60
        while not tier.scan_complete and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tier.usage().entries == 100_000
        assert tier.lookup(keys[12345], None) is LookupResult.HIT
        print(f"100k entries: constructor {started:.3f}s, scan {tier.stats.extra['scan_seconds']:.2f}s")
    finally:
        tier.shutdown()


def test_restart_with_smaller_budget_evicts_oldest(tmp_path: Path, rows: np.ndarray) -> None:
    keys = [key_of(i) for i in range(10)]
    fill(rows, range(10), keys, BB)
    tier = make_tier(tmp_path, rows, BB)
    assert store(tier, keys, list(range(10))).success
    tier.shutdown()
    for i, key in enumerate(keys):  # key i was stored at time 1000 + i
        os.utime(value_path(tier.ns_dir, key), (1000 + i, 1000 + i))
    small = make_tier(tmp_path, rows, BB, max_bytes=4 * ENTRY)
    try:
        assert small.usage().entries == 4
        assert [small.lookup(k, None) for k in keys] == [LookupResult.MISS] * 6 + [LookupResult.HIT] * 4
        assert len(value_files(tmp_path)) == 4 and small.stats.evictions == 6
    finally:
        small.shutdown()


def test_directories_in_tmp_not_named_like_an_instance_are_left_alone(tmp_path: Path, rows: np.ndarray) -> None:
    """Regression (review, 2026-12-02): the start-up sweep emptied any unlocked directory in
    ``tmp`` older than a minute, whatever its name (one not named like an instance's is not
    proven kvtier's)."""
    tier = make_tier(tmp_path, rows, BB)
    tier.shutdown()
    planted = [tier.ns_dir / "tmp" / name for name in ("mystuff", "999999-dead", "12-0123456789AB", "12-0123456789abc")]
    for where in planted:
        where.mkdir()
        (where / "notes.txt").write_text("precious")
        os.utime(where, (time.time() - 3600, time.time() - 3600))
    dead = tier.ns_dir / "tmp" / "999998-0123456789ab"  # a dead instance's, without its lock
    dead.mkdir()
    (dead / "ab.1.tmp").write_bytes(b"partial")
    os.utime(dead, (time.time() - 3600, time.time() - 3600))
    again = make_tier(tmp_path, rows, BB)
    try:
        assert all((where / "notes.txt").read_text() == "precious" for where in planted)
        assert not dead.exists()
    finally:
        again.shutdown()
    report = verify_root(tmp_path)
    left = {Path(entry.path).name for ns in report.namespaces for entry in ns.unsafe_entries}
    assert {where.name for where in planted} <= left


def test_manifest_of_other_data_is_refused(tmp_path: Path, rows: np.ndarray) -> None:
    tier = make_tier(tmp_path, rows, BB)
    tier.shutdown()
    manifest = tier.ns_dir / "manifest.json"
    manifest.write_text(manifest.read_text().replace(f'"block_bytes": {BB}', '"block_bytes": 12345'))
    with pytest.raises(ConfigError, match="block_bytes"):
        make_tier(tmp_path, rows, BB)
    manifest.write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        make_tier(tmp_path, rows, BB)


def test_a_root_on_a_file_system_without_hard_links_starts_and_serves(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (review r10, 2026-12-03): the fix above first named the lock with a hard link,
    so on a file system without them (vfat, exFAT, some FUSE and SMB mounts: EPERM) the tier no
    longer started; values there are placed by rename, and the lock is too."""

    def no_links(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    tier = make_tier(tmp_path, rows, BB)
    try:
        keys = [key_of(i, b"nolinks") for i in range(3)]
        fill(rows, range(3), keys, BB)
        assert store(tier, keys, range(3)).success
        assert tier.describe()["hard_links"] is False
        rows[4:7] = 0
        assert load(tier, keys, range(4, 7)).success and np.array_equal(rows[4:7], rows[0:3])
        (instance,) = (tier.ns_dir / "tmp").iterdir()
        assert sorted(p.name for p in instance.iterdir()) == ["lock"]
    finally:
        tier.shutdown()


def test_a_manifest_nested_too_deeply_is_refused_by_name(tmp_path: Path, rows: np.ndarray) -> None:
    """Regression (review r7, 2026-12-03): a planted manifest of nested arrays (400 KB, under its
    size cap) raised a bare RecursionError from the tier's start and from ``verify_root``."""
    tier = make_tier(tmp_path, rows, BB)
    tier.shutdown()
    manifest = tier.ns_dir / "manifest.json"
    manifest.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ConfigError, match=r"manifest .*manifest\.json is unreadable \(manifest is nested too deeply"):
        make_tier(tmp_path, rows, BB)
    (report,) = verify_root(tmp_path).namespaces
    assert report.manifest_error == "unreadable manifest: manifest is nested too deeply to be one"
    assert manifest.stat().st_size == 400_000, "the planted file is left as it is"


def test_orphaned_temp_files_of_dead_processes_are_swept(tmp_path: Path, rows: np.ndarray) -> None:
    tier = make_tier(tmp_path, rows, BB)
    tier.shutdown()
    dead = tier.ns_dir / "tmp" / "999999-0123456789ab"  # instance directories are named <pid>-<12 hex>
    dead.mkdir()
    (dead / "lock").touch()
    (dead / "ab.1.tmp").write_bytes(b"partial")
    live = tier.ns_dir / "tmp" / "1-abcdefabcdef"
    live.mkdir()
    (live / "cd.1.tmp").write_bytes(b"in progress")
    fd = os.open(live / "lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        again = make_tier(tmp_path, rows, BB)
        try:
            assert not dead.exists()
            assert (live / "cd.1.tmp").exists()
            assert again.swept_temp_files == 1
        finally:
            again.shutdown()
    finally:
        os.close(fd)


def test_an_engine_starting_beside_another_never_sweeps_its_new_instance_directory(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (review r7, 2026-12-03): an instance created its ``lock`` and only then locked
    it; an engine starting at that moment on the same root took the unlocked lock, judged the
    directory dead and removed it (~0.4 % of concurrent starts): the live engine's stores then
    failed for good (ENOENT on its temp files). Here the other engine's sweep runs exactly in
    that window: just before the new instance locks its lock."""
    from kvtier.tiers import fs_layout

    tier = make_tier(tmp_path, rows, BB)
    tier.shutdown()
    real_flock = fs_layout.fcntl.flock
    swept: list[tuple[int, int]] = []
    sweeping: list[bool] = []

    def sweep_then_lock(fd: int, operation: int) -> None:
        if not sweeping:  # the other engine's start: make_dirs, then its sweep of dead instances
            sweeping.append(True)
            other = fs_layout.make_dirs(tier.ns_dir, tier.modes)
            try:
                swept.append(fs_layout.sweep_temp_dirs(other))
            finally:
                other.close()
        real_flock(fd, operation)

    monkeypatch.setattr(fs_layout.fcntl, "flock", sweep_then_lock)
    again = make_tier(tmp_path, rows, BB)
    monkeypatch.undo()
    try:
        assert swept == [(0, 0)], "the sweep ran in the window and swept nothing"
        names = [p.name for p in (tier.ns_dir / "tmp").iterdir()]
        assert len(names) == 1 and (tier.ns_dir / "tmp" / names[0] / "lock").is_file(), names
        keys = [key_of(i, b"beside") for i in range(3)]
        fill(rows, range(3), keys, BB)
        result = store(again, keys, range(3))
        assert result.success and result.successful_keys is None and again.stats.stores_failed == 0
        assert [again.lookup(k, None) for k in keys] == [LookupResult.HIT] * 3
    finally:
        again.shutdown()


# --- corruption -----------------------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


CORRUPTIONS = {
    "payload_byte": lambda path, other: _flip(path, PAYLOAD_OFFSET + BB // 2),
    "last_payload_byte": lambda path, other: _flip(path, PAYLOAD_OFFSET + BB - 1),
    "header_byte": lambda path, other: _flip(path, 40),
    "truncated": lambda path, other: os.truncate(path, PAYLOAD_OFFSET + BB - 1),
    "truncated_to_header": lambda path, other: os.truncate(path, 100),
    "other_keys_file": lambda path, other: shutil.copyfile(other, path),
}


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("damage", sorted(CORRUPTIONS))
def test_corruption_is_a_miss_and_deletes_the_file(
    tmp_path: Path, rows: np.ndarray, damage: str, direct_io: bool
) -> None:
    tier = make_tier(tmp_path, rows, BB, direct_io=direct_io)
    try:
        bad, good = key_of(1), key_of(2)
        fill(rows, [0, 1], [bad, good], BB)
        assert store(tier, [bad, good], [0, 1]).success
        bad_path, good_path = value_path(tier.ns_dir, bad), value_path(tier.ns_dir, good)
        CORRUPTIONS[damage](bad_path, good_path)

        rows[2:4] = 0
        result = load(tier, [bad, good], [2, 3])
        assert not result.success
        assert result.successful_keys == frozenset([good])  # wrong bytes never count as a success
        assert "corrupt" in (result.error or "")
        _check_rows(rows, [3], [good])
        assert tier.stats.corrupt_values == 1
        assert not bad_path.exists() and good_path.exists()
        assert tier.lookup(bad, None) is LookupResult.MISS
        assert tier.usage().entries == 1
        assert any(e.removed and bad in e.keys for e in tier.take_events())
        assert tier.health().state is HealthState.CLOSED  # bad data is not an I/O failure
    finally:
        tier.shutdown()


def _as_version(path: Path, version: int, size: int | None = None) -> None:
    """Rewrite the value at ``path`` as if another release wrote it: its format version (and size)."""
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(version.to_bytes(4, "little"))
        if size is not None:
            f.truncate(size)


@pytest.mark.parametrize("resized", [False, True])
def test_a_value_of_another_releases_format_is_a_miss_and_kept(tmp_path: Path, rows: np.ndarray, resized: bool) -> None:
    """Regression (review, 2026-12-02): an engine sharing a root with a newer release deleted every
    value of the newer format it tried to load (counted as corrupt): a rolling upgrade churned."""
    tier = make_tier(tmp_path, rows, BB)
    try:
        newer, good = key_of(1), key_of(2)
        fill(rows, [0, 1], [newer, good], BB)
        assert store(tier, [newer, good], [0, 1]).success
        path = value_path(tier.ns_dir, newer)
        _as_version(path, 3, PAYLOAD_OFFSET + BB + 4096 if resized else None)
        before = path.read_bytes()
        rows[2:4] = 0
        result = load(tier, [newer, good], [2, 3])
        assert result.successful_keys == frozenset([good])
        _check_rows(rows, [3], [good])
        assert path.read_bytes() == before, "another release's value must be left in place"
        assert tier.stats.corrupt_values == 0 and tier.stats.extra.get("foreign_format") == 1
        assert tier.lookup(newer, None) is LookupResult.MISS
        assert tier.health().state is HealthState.CLOSED
    finally:
        tier.shutdown()
    report = verify_root(tmp_path, remove_corrupt=True)  # kvtier inspect --verify --remove-corrupt
    (ns,) = report.namespaces
    assert ns.removed_corrupt == 0 and path.read_bytes() == before
    assert any("format version 3" in entry.reason and "kept" in entry.reason for entry in ns.corrupt)


# --- capacity ---------------------------------------------------------------------------------


def test_lru_eviction_keeps_recently_used(tmp_path: Path, rows: np.ndarray) -> None:
    tier = make_tier(tmp_path, rows, BB, max_bytes=4 * ENTRY)
    try:
        keys = [key_of(i) for i in range(5)]
        fill(rows, range(5), keys, BB)
        assert store(tier, keys[:4], [0, 1, 2, 3]).success
        tier.touch([keys[0]], None)
        assert tier.lookup(keys[1], None) is LookupResult.HIT  # a hit is a use too
        assert store(tier, [keys[4]], [4]).success
        present = [tier.lookup(k, None) is LookupResult.HIT for k in keys]
        assert present == [True, True, False, True, True]
        assert tier.stats.evictions == 1 and len(value_files(tmp_path)) == 4
        assert any(e.removed and e.keys == (keys[2],) for e in tier.take_events())
    finally:
        tier.shutdown()


def test_evicted_file_is_recycled_and_trimmed(tmp_path: Path) -> None:
    """A store at capacity overwrites the LRU victim's file in place (same inode), trimmed to
    the new value's size (a page-padded O_DIRECT file reused by buffered I/O)."""
    bb = 3 * 4096 + 112
    rows = AlignedRows(4, bb).rows
    old, new = key_of(1), key_of(2)
    fill(rows, [0, 1], [old, new], bb)
    direct = make_tier(tmp_path, rows, bb, direct_io=True)
    assert store(direct, [old], [0]).success
    direct.shutdown()
    old_path = value_path(direct.ns_dir, old)
    inode, size = old_path.stat().st_ino, old_path.stat().st_size
    assert size == entry_bytes(bb)

    tier = make_tier(tmp_path, rows, bb, direct_io=False, max_bytes=entry_bytes(bb))
    try:
        assert store(tier, [new], [1]).success
        new_path = value_path(tier.ns_dir, new)
        assert not old_path.exists() and new_path.stat().st_ino == inode
        assert new_path.stat().st_size == PAYLOAD_OFFSET + bb
        rows[2:4] = 0
        assert load(tier, [new], [2]).success
        _check_rows(rows, [2], [new], bb)
        assert tier.lookup(old, None) is LookupResult.MISS and tier.stats.evictions == 1
    finally:
        tier.shutdown()


def test_directory_never_exceeds_budget_under_store_stream(tmp_path: Path, rows: np.ndarray) -> None:
    # Sampled with statvfs on a dedicated tmpfs: an atomic view of the bytes in use (a
    # directory walk races with renames and evictions and would double count).
    mnt = tmp_path / "cap"
    _mount_tmpfs(mnt, "16m")
    budget = 6 * ENTRY
    try:
        tier = make_tier(mnt, rows, BB, max_bytes=budget, write_threads=2)

        def used() -> int:
            st = os.statvfs(mnt)
            return (st.f_blocks - st.f_bfree) * st.f_frsize

        baseline = used()  # the manifest and lock file
        peak = 0
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, used() - baseline)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            for start in range(0, 240, 8):
                keys = [key_of(i) for i in range(start, start + 8)]
                fill(rows, range(8), keys, BB)
                assert store(tier, keys, list(range(8))).success
        finally:
            stop.set()
            sampler.join()
            tier.shutdown()
        assert 0 < peak <= budget + ENTRY, f"peak {peak} > budget {budget} + one block"
        assert dir_bytes(mnt) <= budget
        assert tier.stats.evictions == 240 - 6
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_index_never_evicts_pinned_entries() -> None:
    """How many files must go is the shared budget's call (test_fs_share.py); which ones is the
    index's: least recently used first, never one a load is reading."""
    index = FileIndex()
    for key in (b"a", b"b"):
        assert index.reserve(key) is Reservation.GRANTED
        index.commit(key)
    assert index.pin(b"a") and index.pin(b"b")
    assert index.reserve(b"c") is Reservation.GRANTED
    assert index.take_victims(1) == []  # everything is pinned: nothing to evict
    index.unpin(b"a")
    victims = index.take_victims(2)
    assert victims == [b"a"]
    assert index.reserve(b"a") is Reservation.BUSY  # deletion not finished yet
    index.finish_delete(victims)
    index.commit(b"c")
    assert index.keys() == [b"b", b"c"] and len(index) == 2
    assert index.reserve(b"b") is Reservation.PRESENT


def test_small_budget_refused(tmp_path: Path, rows: np.ndarray) -> None:
    with pytest.raises(ConfigError, match="max_bytes"):
        make_tier(tmp_path, rows, BB, max_bytes=ENTRY - 1)


def test_default_budget_is_half_the_free_space(tmp_path: Path, rows: np.ndarray) -> None:
    tier = make_tier(tmp_path, rows, BB)
    try:
        free = shutil.disk_usage(tmp_path).free
        assert 0.4 * free < tier.max_bytes < 0.6 * free
    finally:
        tier.shutdown()


# --- ENOSPC and health on real small file systems -------------------------------------------------


def test_enospc_fails_store_cleanly_and_tier_keeps_working(small_fs: Path) -> None:
    bb = 1 << 20
    rows = AlignedRows(16, bb).rows
    filler = small_fs / "filler"
    filler.write_bytes(bytes(3 << 20))
    tier = make_tier(small_fs, rows, bb, max_bytes=1 << 30, probe_interval=0.05)
    try:
        keys = [key_of(i, b"enospc") for i in range(12)]
        fill(rows, range(12), keys, bb)
        outcomes = [store(tier, [k], [i]).success for i, k in enumerate(keys[:8])]
        assert outcomes[0] and not all(outcomes), outcomes
        stored = [k for k, ok in zip(keys, outcomes, strict=False) if ok]
        assert tier.stats.extra["enospc"] >= 1 and tier.stats.stores_failed >= 1
        assert tier.health().state is HealthState.CLOSED  # a full disk is not a broken one
        assert temp_files(small_fs) == []
        assert tier.usage().capacity_bytes < 1 << 30
        # Earlier blocks still load, byte exact.
        rows[12:16] = 0
        probe = stored[-2:]
        assert load(tier, probe, [12, 13]).success
        _check_rows(rows, [12, 13], probe, bb)
        # New stores keep working by evicting within the lowered capacity.
        for i in (8, 9):
            assert store(tier, [keys[i]], [i]).success
        # Once space is freed, the capacity grows back.
        lowered = tier.usage().capacity_bytes
        entries_before = tier.usage().entries
        filler.unlink()
        time.sleep(0.1)
        assert store(tier, [keys[10]], [10]).success
        assert store(tier, [keys[11]], [11]).success
        assert tier.usage().capacity_bytes > lowered
        assert tier.usage().entries > entries_before
    finally:
        tier.shutdown()


def test_io_errors_take_tier_out_of_service_and_probe_brings_it_back(small_fs: Path) -> None:
    rows = AlignedRows(8, BB).rows
    tier = make_tier(small_fs, rows, BB, max_bytes=4 << 20, failure_threshold=3, probe_interval=0.2)
    try:
        keys = [key_of(i, b"health") for i in range(8)]
        fill(rows, range(8), keys, BB)
        assert store(tier, keys[:2], [0, 1]).success
        subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
        try:
            for i in (2, 3, 4):
                result = store(tier, [keys[i]], [i])
                assert not result.success and "failed" in (result.error or "")
            assert tier.health().state is HealthState.OPEN
            assert tier.lookup(keys[0], None) is LookupResult.MISS
            result = store(tier, [keys[5]], [5])
            assert not result.success and tier.stats.stores_dropped >= 1
            time.sleep(0.25)
            tier.on_schedule_end()  # probe while still read-only: fails
            deadline = time.monotonic() + 5
            while tier._breaker.state is HealthState.HALF_OPEN and time.monotonic() < deadline:
                time.sleep(0.01)
            assert tier.health().state is HealthState.OPEN
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
        deadline = time.monotonic() + 5
        while tier.health().state is not HealthState.CLOSED and time.monotonic() < deadline:
            tier.on_schedule_end()
            time.sleep(0.02)
        assert tier.health().state is HealthState.CLOSED
        assert tier.lookup(keys[0], None) is LookupResult.HIT
        assert store(tier, [keys[6]], [6]).success
        assert tier.stats.extra["io_errors"] >= 3
    finally:
        tier.shutdown()


def test_unaligned_rows_fall_back_to_buffered_io(tmp_path: Path) -> None:
    backing = np.zeros((4, BB + 64), dtype=np.uint8)
    tier = make_tier(tmp_path, backing[:, 64:], BB)
    try:
        assert not tier.direct_io and "aligned" in tier.direct_io_reason
        rows = backing[:, 64:]
        keys = [key_of(1)]
        fill(rows, [0], keys, BB)
        assert store(tier, keys, [0]).success and load(tier, keys, [1]).success
        _check_rows(rows, [1], keys)
    finally:
        tier.shutdown()
    with pytest.raises(ConfigError, match="aligned"):
        make_tier(tmp_path, backing[:, 64:], BB, direct_io=True)


# --- threads, drain, shutdown ---------------------------------------------------------------------


def test_loads_are_served_before_queued_stores(tmp_path: Path, rows: np.ndarray) -> None:
    """The only write thread works through a long store; a load submitted after it still
    finishes first (a read thread takes it, and the write thread would take it before the
    next queued store)."""
    tier = make_tier(tmp_path, rows, BB, read_threads=1, write_threads=1, fsync=True)
    try:
        (hot,) = [key_of(10_000)]
        fill(rows, [0], [hot], BB)
        assert store(tier, [hot], [0]).success
        keys = [key_of(i) for i in range(24)]
        fill(rows, range(24), keys, BB)
        tier.submit_store(TransferJob(7001, keys, np.arange(24), is_promotion=False))
        tier.submit_load(TransferJob(7002, [hot], np.asarray([30]), is_promotion=True))
        order: list[int] = []
        deadline = time.monotonic() + 30
        while len(order) < 2:
            assert time.monotonic() < deadline
            order.extend(r.job_id for r in tier.poll_finished())
            time.sleep(0.0005)
        assert order == [7002, 7001]
    finally:
        tier.shutdown()


def test_drain_waits_for_every_job(tmp_path: Path, rows: np.ndarray) -> None:
    tier = make_tier(tmp_path, rows, BB, fsync=True)
    try:
        for j in range(4):
            keys = [key_of(i) for i in range(j * 8, j * 8 + 8)]
            fill(rows, range(8), keys, BB)
            tier.submit_store(TransferJob(100 + j, keys, np.arange(8), is_promotion=False))
            tier.drain(timeout=30)  # rows are rewritten next round: the job must be done
        assert tier.has_pending_work(), "results not yet polled are pending work (the engine keeps stepping)"
        results = tier.poll_finished()
        assert sorted(r.job_id for r in results) == [100, 101, 102, 103]
        assert all(r.success for r in results)
        assert not tier.has_pending_work()
    finally:
        tier.shutdown()


def test_shutdown_finishes_queued_jobs_and_releases_rows(tmp_path: Path) -> None:
    region = AlignedRows(32, BB)
    tier = make_tier(tmp_path, region.rows, BB, read_threads=1, write_threads=1)
    keys = [key_of(i) for i in range(32)]
    fill(region.rows, range(32), keys, BB)
    tier.submit_store(TransferJob(1, keys, np.arange(32), is_promotion=False))
    instance_dir = tier._instance.path
    tier.shutdown()
    results = tier.poll_finished()
    assert [r.job_id for r in results] == [1] and results[0].success
    assert not [t for t in threading.enumerate() if t.name.startswith("kvtier-fs")]
    assert tier.context.rows.size == 0 and not instance_dir.exists()
    with pytest.raises(TierError, match="shut down"):
        tier.submit_load(TransferJob(2, keys[:1], np.arange(1), is_promotion=True))
    tier.shutdown()  # idempotent
    gc.collect()
    region.close()  # raises BufferError if any view of the rows survived


# --- offline verification -------------------------------------------------------------------------


def test_verify_root_reports_and_removes_corrupt_entries(tmp_path: Path, rows: np.ndarray) -> None:
    tier = make_tier(tmp_path, rows, BB)
    keys = [key_of(i) for i in range(5)]
    fill(rows, range(5), keys, BB)
    assert store(tier, keys, list(range(5))).success
    tier.shutdown()
    _flip(value_path(tier.ns_dir, keys[3]), PAYLOAD_OFFSET + 10)
    (tier.ns_dir / "ab" / "stray.txt").write_text("hello")

    report = verify_root(tmp_path)
    assert not report.ok and report.entries == 5 and report.corrupt == 1
    (ns,) = report.namespaces
    assert ns.digest == tier.ns_dir.name and ns.verified == 4 and ns.bytes == 5 * (PAYLOAD_OFFSET + BB)
    assert "checksum" in ns.corrupt[0].reason and ns.foreign_files[0].endswith("stray.txt")
    data = report.to_dict()
    assert data["namespaces"][0]["model_id"] == "test/fs-model" and data["namespaces"][0]["block_bytes"] == BB

    quick = verify_root(tmp_path, check_payloads=False)
    assert quick.ok and quick.entries == 5
    assert verify_root(tmp_path, namespace="ffff").namespaces == [] or tier.ns_dir.name.startswith("ffff")

    fixed = verify_root(tier.ns_dir, remove_corrupt=True)
    assert fixed.namespaces[0].removed_corrupt == 1
    after = verify_root(tmp_path)
    assert after.ok and after.entries == 4
    with pytest.raises(ConfigError):
        verify_root(tmp_path / "missing")


def test_verify_root_never_judges_a_value_a_live_engine_is_recycling(tmp_path: Path, rows: np.ndarray) -> None:
    """Regression (review r7, 2026-12-03): ``kvtier inspect --verify`` opened value files without
    the shared lock a tier's reader takes, so a file an engine was rewriting for another key
    (recycling it: exclusive lock, then rewritten in place) was read half written and listed
    as corrupt (and, with ``--remove-corrupt``, deleted if it was still at its name)."""
    tier = make_tier(tmp_path, rows, BB)
    keys = [key_of(i) for i in range(3)]
    fill(rows, range(3), keys, BB)
    assert store(tier, keys, list(range(3))).success
    tier.shutdown()
    path = value_path(tier.ns_dir, keys[2])
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the recycler's lock, then its rewrite, half done
        os.pwrite(fd, b"\xa5" * 4096, PAYLOAD_OFFSET)
        report = verify_root(tmp_path, remove_corrupt=True)
        (ns,) = report.namespaces
        assert report.ok and ns.corrupt == [] and ns.removed_corrupt == 0 and ns.verified == 2, ns
        assert path.exists()
    finally:
        os.close(fd)
    report = verify_root(tmp_path)  # unlocked and still scribbled: now it is corrupt
    assert report.corrupt == 1 and "checksum" in report.namespaces[0].corrupt[0].reason


def test_stores_are_shed_when_the_write_queue_is_full(tmp_path: Path, rows: np.ndarray) -> None:
    tier = make_tier(tmp_path, rows, BB, write_threads=1, fsync=True, max_queued_stores=4)
    try:
        first = [key_of(i) for i in range(16)]
        second = [key_of(i) for i in range(16, 20)]
        fill(rows, range(20), first + second, BB)
        tier.submit_store(TransferJob(1, first, np.arange(16), is_promotion=False))
        tier.submit_store(TransferJob(2, second, np.arange(16, 20), is_promotion=False))
        tier.drain(timeout=60)
        results = {r.job_id: r for r in tier.poll_finished()}
        assert results[1].success
        assert not results[2].success and results[2].successful_keys == frozenset()
        assert "queue full" in (results[2].error or "")
        assert tier.stats.stores_dropped == 4
        assert all(tier.lookup(k, None) is LookupResult.MISS for k in second)
    finally:
        tier.shutdown()


@pytest.mark.parametrize(
    "options",
    [{"read_threads": 0}, {"write_threads": 0}, {"direct_io": "sometimes"}, {"probe_interval": 0}],
)
def test_bad_options_are_config_errors(tmp_path: Path, rows: np.ndarray, options: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        make_tier(tmp_path, rows, BB, **options)


def test_a_format_1_manifest_of_another_block_size_is_refused_and_left_as_it_is(
    tmp_path: Path, rows: np.ndarray
) -> None:
    """Regression (review, 2026-12-04): the format-1 manifest was rewritten to name format 2 before
    its other fields were compared, so a refused directory's manifest changed on disk (and a
    format-1-only engine that owns it was locked out)."""
    import json

    tier = make_tier(tmp_path, rows, BB)
    tier.shutdown()
    (manifest_path,) = tmp_path.glob("*/manifest.json")
    planted = json.dumps({**json.loads(manifest_path.read_text()), "value_format_version": 1, "block_bytes": 4096})
    manifest_path.write_text(planted)
    with pytest.raises(ConfigError, match="block_bytes=4096"):
        make_tier(tmp_path, rows, BB)
    assert manifest_path.read_text() == planted


def test_a_root_of_an_older_release_is_read_and_its_manifest_upgraded(tmp_path: Path, rows: np.ndarray) -> None:
    """Values of the format-1 era stay servable; the manifest then names format 2, so a
    format-1-only release refuses the directory instead of mistaking long-key values for corrupt."""
    import json

    keys = store_three(tmp_path, rows, BB, b"old")
    (manifest_path,) = tmp_path.glob("*/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    manifest["value_format_version"] = 1
    manifest_path.write_text(json.dumps(manifest))
    rows[:3] = 0
    tier = make_tier(tmp_path, rows, BB)
    try:
        assert load(tier, keys, [0, 1, 2]).success
        _check_rows(rows, [0, 1, 2], keys)
    finally:
        tier.shutdown()
    assert json.loads(manifest_path.read_text())["value_format_version"] == 2


@pytest.mark.parametrize("field", ["root", "share_group"])
def test_a_nul_character_in_a_path_or_group_is_refused_by_the_options(tmp_path: Path, field: str) -> None:
    """Regression (2026-12-06, review): a NUL in ``root`` or ``share_group`` passed the option checks
    (``config show`` printed it) and failed at start-up as "ValueError: embedded null byte (an
    input no check caught)"; from Python a plain ValueError, not a ConfigError."""
    from kvtier.tiers.fs import FilesystemTierOptions

    options = {"root": str(tmp_path), field: "g\0x"}
    with pytest.raises(ValueError, match=f"{field}[\\s\\S]*holds a NUL character") as caught:
        FilesystemTierOptions(**options)  # type: ignore[arg-type]
    assert "\0" not in str(caught.value)
    from kvtier.config import load_config

    with pytest.raises(ConfigError, match="holds a NUL character"):
        load_config(env={}, cli={"tiers": [{"type": "fs", **options}]})
