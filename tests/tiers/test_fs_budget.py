"""The shared file count of an fs namespace (:mod:`kvtier.tiers.fs_budget`) across engines killed
with SIGKILL while storing: the ledgers end where the disk is, never creeping up with every kill
until the namespace is counted full while empty; a dead engine's temp files go once its ledger is
adopted."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import random
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fs_helpers import AlignedRows, block_bytes_for, fill, key_of, load, make_tier, store, temp_files, value_files

from kvtier.tiers.base import JobResult
from kvtier.tiers.fs import FilesystemTier
from kvtier.tiers.fs_budget import MAX_UNSETTLED, RECORD_BYTES, pack_record, parse_record, read_record
from kvtier.tiers.fs_layout import LEDGER_DIR, LOCK_FILE, TMP_DIR, entry_bytes

BB = 16 * 1024
ENTRY = entry_bytes(BB)
HERE = Path(__file__).parent
BOUND_CHILD = HERE / "fs_bound_child.py"

# A real engine process: an fs tier with two write threads whose stores stop while writing their
# file (after the claim, before the link), so that the SIGKILL the test sends lands there.
_STUCK_CHILD = textwrap.dedent(
    """
    import sys, threading, time
    sys.path.insert(0, sys.argv[1])
    import kvtier.tiers.fs as fs
    from fs_helpers import AlignedRows, fill, key_of, make_tier, store

    BB = 16 * 1024
    entered = threading.Semaphore(0)
    def stuck(*args, **kwargs):
        entered.release()
        time.sleep(3600)
    fs.write_value = stuck
    rows = AlignedRows(4, BB).rows
    tier = make_tier(sys.argv[2], rows, BB, max_bytes=int(sys.argv[3]), write_threads=2, direct_io=False)
    keys = [key_of(i, sys.argv[4].encode()) for i in range(2)]
    fill(rows, range(2), keys, BB)
    for i in range(2):
        threading.Thread(target=store, args=(tier, keys[i : i + 1], [i]), daemon=True).start()
    entered.acquire(); entered.acquire()
    print("in-window", flush=True)
    time.sleep(3600)
    """
)


def _kill_mid_store(root: Path, max_bytes: int, tag: str) -> None:
    """Start an engine process, wait until both its write threads hold a claim whose file they
    are writing, and kill it with SIGKILL."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUCK_CHILD, str(HERE), str(root), str(max_bytes), tag],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "in-window", proc.stderr.read() if proc.stderr else line
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def _ledger_sum(ns_dir: Path) -> int:
    return sum(parse_record(p.read_bytes()) or 0 for p in (ns_dir / LEDGER_DIR).iterdir() if p.is_file())


def _only_live_entries(where: str, live: tuple[FilesystemTier, ...], timeout: float) -> None:
    """Wait until the entries of ``where`` (``ledger`` or ``tmp``) are those of the ``live`` tiers."""
    folder = live[0].ns_dir / where
    names = sorted(tier.describe()["instance"] for tier in live)
    deadline = time.monotonic() + timeout
    while sorted(p.name for p in folder.iterdir()) != names:
        assert time.monotonic() < deadline, sorted(p.name for p in folder.iterdir())
        time.sleep(0.02)


def _dead_adopted(*live: FilesystemTier, timeout: float = 20.0) -> None:
    """Wait until the ledgers left are those of the ``live`` tiers (housekeeping adopts dead
    ones every second)."""
    _only_live_entries(LEDGER_DIR, live, timeout)


def _only_live_temp_dirs(*live: FilesystemTier, timeout: float = 10.0) -> None:
    """Wait until the temp directories left are those of the ``live`` tiers (swept at adoption)."""
    _only_live_entries(TMP_DIR, live, timeout)


@pytest.fixture
def rows() -> Iterator[np.ndarray]:
    yield AlignedRows(8, BB).rows


def test_engines_killed_mid_store_leave_no_phantom_files_in_the_shared_count(tmp_path: Path, rows: np.ndarray) -> None:
    """Regression (audit, 2026-12-05): a store counts its file in its engine's ledger before
    writing it; an engine killed meanwhile left that count in its ledger and the survivor adopted
    it as a file, so the count crept up by one per store in flight at every kill. Four such kills
    (two stores each, each evicting for its room) against a budget of 4 files left the survivor
    with an empty namespace it believed full, dropping every store ("no room"). Now the ledger
    says how many of its claims are unsettled and the adopter counts them off; the dead engine's
    temp files go with the adoption."""
    budget = 4
    survivor = make_tier(tmp_path, rows, BB, max_bytes=budget * ENTRY, direct_io=False)
    ns_dir = survivor.ns_dir
    try:
        keys = [key_of(i, b"survivor") for i in range(budget)]
        fill(rows, range(budget), keys, BB)
        assert store(survivor, keys, range(budget)).success
        for k in range(4):
            _kill_mid_store(tmp_path, budget * ENTRY, f"killed-{k}")
            _dead_adopted(survivor)
            assert _ledger_sum(ns_dir) == len(value_files(ns_dir)), f"after kill {k}"
            _only_live_temp_dirs(survivor)
            assert temp_files(ns_dir) == [], "the dead engine's temp files outlived its adoption"
        assert survivor.describe()["ledgers_adopted"] == 4
        fresh = [key_of(i, b"after-kills") for i in range(budget)]
        fill(rows, range(budget), fresh, BB)
        assert store(survivor, fresh, range(budget)).success
        rows[4:8] = 0
        assert load(survivor, fresh, range(4, 8)).success
        for i, key in enumerate(fresh):
            assert np.array_equal(rows[4 + i, :BB], block_bytes_for(key, BB))
        assert len(value_files(ns_dir)) == budget and _ledger_sum(ns_dir) == budget
        assert survivor.usage().used_bytes == budget * ENTRY
    finally:
        survivor.shutdown()


def test_an_engine_restarted_at_once_after_a_kill_counts_what_is_on_disk(tmp_path: Path, rows: np.ndarray) -> None:
    """The engine restarted right after the kill (same root and namespace, another engine alive,
    so its start does not reset the count) sweeps the dead temp directory at its start; the
    adoption still counts off the unsettled claims (the proof is in the ledger, not the temp files)."""
    budget = 6
    survivor = make_tier(tmp_path, rows, BB, max_bytes=budget * ENTRY, direct_io=False)
    ns_dir = survivor.ns_dir
    restarted = None
    try:
        keys = [key_of(i, b"kept") for i in range(3)]
        fill(rows, range(3), keys, BB)
        assert store(survivor, keys, range(3)).success
        _kill_mid_store(tmp_path, budget * ENTRY, "restart")
        restarted = make_tier(tmp_path, AlignedRows(4, BB).rows, BB, max_bytes=budget * ENTRY, direct_io=False)
        _dead_adopted(survivor, restarted)
        assert _ledger_sum(ns_dir) == len(value_files(ns_dir)) == 3
        assert temp_files(ns_dir) == []
    finally:
        survivor.shutdown()
        if restarted is not None:
            restarted.shutdown()


@pytest.mark.slow
def test_engines_killed_at_random_moments_leave_the_count_near_the_disk(tmp_path: Path, rows: np.ndarray) -> None:
    """Held-out kill timing: real engines storing and evicting flat out in a shared pool (the
    bound tests' child) killed at random moments, twelve times, while one engine lives. Each
    kill used to add about one phantom file; now a kill adds one only if it lands between a
    claim's settling and its link or between an eviction's unlink and its count (microseconds
    of a store's hundreds), so the drift stays within a few files; and it is only ever too high."""
    budget = 24
    rng = random.Random(20261205)
    survivor = make_tier(tmp_path, rows, BB, max_bytes=budget * ENTRY, direct_io=False)
    ns_dir = survivor.ns_dir
    try:
        for seed in range(12):
            proc = subprocess.Popen(
                [sys.executable, str(BOUND_CHILD), str(tmp_path), str(seed), "30", str(budget)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert proc.stdout is not None and proc.stdin is not None
            assert proc.stdout.readline().strip() == "ready"
            proc.stdin.write("go\n")
            proc.stdin.flush()
            time.sleep(rng.uniform(0.05, 0.4))
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
            assert proc.returncode == -signal.SIGKILL
        _dead_adopted(survivor)
        files = len(value_files(ns_dir))
        drift = _ledger_sum(ns_dir) - files
        print(f"files on disk {files}, ledger sum {files + drift} after 12 kills")
        assert 0 <= drift <= 3, f"the ledgers count {drift} files that are not there"
        assert files <= budget
        _only_live_temp_dirs(survivor)
    finally:
        survivor.shutdown()


def test_unsettled_claims_round_trip_and_older_records_read_as_none_unsettled() -> None:
    record = pack_record(9, 123, unsettled=2)
    assert len(record) == RECORD_BYTES
    assert read_record(record) == (9, 2) and parse_record(record) == 9
    assert read_record(pack_record(-3, 2**50 + 5)) == (-3, 0), "the sequence never spills into the claims"
    assert read_record(pack_record(1, 1, MAX_UNSETTLED)) == (1, MAX_UNSETTLED)
    assert read_record(b"") == (0, 0)
    assert read_record(record[:-1]) is None
    with pytest.raises(ValueError, match="unsettled claims"):
        pack_record(1, 1, MAX_UNSETTLED + 1)


@pytest.mark.parametrize(("unsettled", "expected"), [(2, 3), (0, 5)], ids=["this-release", "older-release"])
def test_an_adopted_ledger_counts_off_its_unsettled_claims(
    tmp_path: Path, rows: np.ndarray, unsettled: int, expected: int
) -> None:
    """A dead instance's ledger counting 5 with 2 unsettled claims is adopted as 3; an older
    release's record (no unsettled count) is adopted whole, as before."""
    other = make_tier(tmp_path, AlignedRows(2, BB).rows, BB)  # alive: the next start is not alone
    ns_dir = other.ns_dir
    name = "4242-abcdefabcdef"
    (ns_dir / TMP_DIR / name).mkdir(mode=0o700)
    (ns_dir / TMP_DIR / name / LOCK_FILE).touch(0o600)
    (ns_dir / LEDGER_DIR / name).write_bytes(pack_record(5, 7, unsettled))
    tier = make_tier(tmp_path, rows, BB)
    try:
        _dead_adopted(other, tier)
        assert tier.describe()["ledgers_adopted"] + other.describe()["ledgers_adopted"] == 1
        assert _ledger_sum(ns_dir) == expected
    finally:
        tier.shutdown()
        other.shutdown()


def _write_fds_on(path: Path) -> list[int]:
    """This process's descriptors open for writing on ``path`` (from /proc/self/fdinfo)."""
    found = []
    for entry in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{entry}") != str(path):
                continue
            flags = int(Path(f"/proc/self/fdinfo/{entry}").read_text().split("flags:")[1].split()[0], 8)
        except (OSError, IndexError, ValueError):
            continue
        if flags & (os.O_WRONLY | os.O_RDWR):
            found.append(int(entry))
    return found


def test_an_idle_tier_holds_no_ledger_open_for_writing(tmp_path: Path, rows: np.ndarray) -> None:
    """The ledger's write descriptor is kept while stores are queued (cheaper publishes) and
    closed when the queue runs empty, before the store is reported, so an engine that just
    stored does not keep the file system from being remounted read-only."""
    tier = make_tier(tmp_path, rows, BB, max_bytes=2 * ENTRY, direct_io=False)
    ledger = tier.ns_dir / LEDGER_DIR / tier.describe()["instance"]
    try:
        keys = [key_of(i, b"idle") for i in range(4)]
        fill(rows, range(4), keys, BB)
        assert store(tier, keys, range(4)).success  # evicts: claims, releases and settles published
        assert read_record(ledger.read_bytes()) == (2, 0)
        assert not _write_fds_on(ledger), "the ledger stayed open for writing once the store queue ran empty"
        assert store(tier, [key_of(9, b"idle")], [0]).success  # opened again at the next publish
        assert read_record(ledger.read_bytes()) == (2, 0)
    finally:
        tier.shutdown()
    assert not _write_fds_on(ledger)


_IN_CLOSE_WRITE, _IN_OPEN = 0x8, 0x20


@contextlib.contextmanager
def _closes_for_writing(path: Path) -> Iterator[list[int]]:
    """Count the descriptors open for writing on ``path`` that are closed (inotify
    IN_CLOSE_WRITE), in the list yielded, filled in when the block ends. Opens are watched too:
    inotify merges identical events in a row, never an open between two closes."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "inotify_init1"):
        pytest.skip("no inotify")
    ino = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if ino < 0:
        pytest.skip(f"no inotify: {os.strerror(ctypes.get_errno())}")
    counted: list[int] = []
    try:
        assert libc.inotify_add_watch(ino, str(path).encode(), _IN_CLOSE_WRITE | _IN_OPEN) >= 0
        yield counted
        masks = []
        with contextlib.suppress(BlockingIOError):
            while data := os.read(ino, 65536):
                masks += [struct.unpack_from("iIII", data, at)[1] for at in range(0, len(data), 16)]
        counted.append(sum(1 for mask in masks if mask & _IN_CLOSE_WRITE))
    finally:
        os.close(ino)


def test_a_busy_tier_closes_its_ledger_for_writing_at_every_housekeeping_tick(tmp_path: Path, rows: np.ndarray) -> None:
    """Regression (audit, 2026-12-05): the ledger's write descriptor was kept for as long as
    stores stayed queued, and on NFS a client sends its writes to the server when the file is
    closed (close-to-open consistency, as the journal's appends rely on): a busy engine's
    claims, thousands of publishes a second, reached no other host until its queue ran empty
    (3,000 stores in about 0.7 s: one close, at the end), so the other hosts evicted against a
    stale count and the namespace overshot its bound for as long as the engine stayed busy.
    Now the descriptor is closed at every housekeeping tick (50 ms), busy or not."""
    tier = make_tier(tmp_path, rows, BB, max_bytes=64 * ENTRY, direct_io=False)
    ledger = tier.ns_dir / LEDGER_DIR / tier.describe()["instance"]
    try:
        fill(rows, range(8), [key_of(i, b"busy") for i in range(8)], BB)
        warm = [key_of(i, b"warm-up") for i in range(200)]
        started = time.monotonic()
        assert store(tier, warm, [i % 8 for i in range(len(warm))]).success
        per_store = (time.monotonic() - started) / len(warm)
        keys = [key_of(i, b"busy") for i in range(max(3000, min(30000, int(0.5 / per_store))))]
        with _closes_for_writing(ledger) as closes:
            started = time.monotonic()
            assert store(tier, keys, [i % 8 for i in range(len(keys))]).success  # one job: stores stay queued
            took = time.monotonic() - started
        assert took > 0.15, f"the store job took {took:.3f} s: too short to span housekeeping ticks"
        assert closes[0] >= 3, f"{closes[0]} closes of the ledger in {took:.2f} s of stores"
        assert read_record(ledger.read_bytes()) == (64, 0)
    finally:
        tier.shutdown()


def test_a_ledger_that_cannot_be_checked_after_its_open_is_not_left_open(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (audit, 2026-12-05): a publish opens the ledger and checks (``fstat``) that it
    is this instance's; an fstat that failed (EIO, or ESTALE on NFS) left the descriptor open,
    unknown to anyone, for good: one descriptor open for writing leaked per failure (the file
    system could not be remounted read-only). The count is published again once it can be."""
    tier = make_tier(tmp_path, rows, BB, max_bytes=4 * ENTRY, direct_io=False)
    ledger = tier.ns_dir / LEDGER_DIR / tier.describe()["instance"]
    real_fstat = os.fstat

    def failing_fstat(fd: int) -> os.stat_result:
        if isinstance(fd, int) and fd in _write_fds_on(ledger):
            raise OSError(errno.EIO, "injected: fstat of the ledger failed")
        return real_fstat(fd)

    try:
        keys = [key_of(i, b"fstat") for i in range(2)]
        fill(rows, range(2), keys, BB)
        monkeypatch.setattr(os, "fstat", failing_fstat)
        assert store(tier, keys[:1], [0]).success  # every publish of this store fails its check
        monkeypatch.setattr(os, "fstat", real_fstat)
        assert not _write_fds_on(ledger), "descriptors of failed publishes were left open"
        assert store(tier, keys[1:], [1]).success
        assert read_record(ledger.read_bytes()) == (2, 0)
        assert not _write_fds_on(ledger)
    finally:
        monkeypatch.setattr(os, "fstat", real_fstat)
        tier.shutdown()


def _store_while(monkeypatch: pytest.MonkeyPatch, tier: FilesystemTier, rows: np.ndarray, salt: bytes,
                 call: str, replacement: object) -> tuple[bytes, JobResult]:
    """Store one block (its key made of ``salt``, row 0) while ``os.<call>`` is ``replacement``."""
    key = key_of(0, salt)
    fill(rows, [0], [key], BB)
    with monkeypatch.context() as patched:
        patched.setattr(os, call, replacement)
        result = store(tier, [key], [0])
    return key, result


def test_a_value_linked_before_its_directory_fsync_failed_stays_counted(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (audit, 2026-12-05): with ``fsync``, a store whose file was linked into its
    shard and whose fsync of the shard directory then failed (EIO) gave its claim back: the
    file stayed on disk, counted by no ledger, so the namespace was counted a file below the
    truth for good (the bound overshot; every engine killed or not). Now the store still fails,
    and the linked file stays counted."""
    tier = make_tier(tmp_path, rows, BB, max_bytes=4 * ENTRY, direct_io=False, fsync=True)
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "injected: fsync of a directory failed")
        real_fsync(fd)

    try:
        _, result = _store_while(monkeypatch, tier, rows, b"dir-fsync", "fsync", failing_fsync)
        assert not result.success and "injected" in (result.error or "")
        assert len(value_files(tier.ns_dir)) == 1, "the value was not linked: the injection missed its moment"
        assert _ledger_sum(tier.ns_dir) == 1, "a linked value was counted off the shared budget"
    finally:
        tier.shutdown()


def test_a_value_linked_whose_temp_name_could_not_be_removed_is_stored_and_counted(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (review, 2026-12-05): with hard links, a store whose file was linked at its
    name and whose removal of the temp name then failed (EIO, ESTALE on NFS) gave its claim back
    and removed nothing: the value stood at its name, counted by no ledger. Now the store
    succeeds (the value is there) and stays counted; the temp link left behind goes with the
    next store of the key."""
    tier = make_tier(tmp_path, rows, BB, max_bytes=4 * ENTRY, direct_io=False)
    real_unlink = os.unlink

    def failing_unlink(path: str, *, dir_fd: int | None = None) -> None:
        if str(path).endswith(".tmp"):
            raise OSError(errno.EIO, "injected: unlink of a temp name failed")
        real_unlink(path, dir_fd=dir_fd)

    try:
        key, result = _store_while(monkeypatch, tier, rows, b"tmp-unlink", "unlink", failing_unlink)
        assert tier._hard_links, "this file system has no hard links: the path under test is not taken"
        assert result.success, result.error
        assert len(value_files(tier.ns_dir)) == 1 and _ledger_sum(tier.ns_dir) == 1
        rows[1] = 0
        assert load(tier, [key], [1]).success
        assert np.array_equal(rows[1, :BB], block_bytes_for(key, BB))
    finally:
        tier.shutdown()
