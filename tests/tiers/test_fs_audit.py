"""The fs tier under conditions an outside audit found it mishandled, each against real files
(and a real tmpfs where the condition is a full disk)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fs_helpers import AlignedRows, block_bytes_for, fill, key_of, load, make_tier, mount_tmpfs, store, store_three

from kvtier.tiers.fs_layout import entry_bytes

BB = 16 * 1024
ENTRY = entry_bytes(BB)


@pytest.fixture
def rows() -> np.ndarray:
    return AlignedRows(32, BB).rows


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 512 KiB tmpfs, unmounted afterwards."""
    mnt = tmp_path / "small"
    why = mount_tmpfs(mnt, "512k")
    if why is not None:
        pytest.skip(f"cannot mount a tmpfs here ({why}); the test needs root or CAP_SYS_ADMIN")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill_up(path: Path) -> None:
    """Write ``path`` until the file system has not one byte left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for size in (4096, 512, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as full:
        path.with_name("probe").write_bytes(b"x")
    assert full.value.errno == errno.ENOSPC


def test_a_restart_on_a_disk_the_tier_filled_starts_and_serves_it(small_fs: Path, rows: np.ndarray) -> None:
    """An fs tier fills its file system (ENOSPC lowers its capacity, as documented); the engine
    restarts: the tier must start and serve the values on disk, not fail its start (a raw ENOSPC
    from writing its new ledger, which also left that empty ledger behind), and store again once
    there is room."""
    root = small_fs / "kv"
    keys = [key_of(i) for i in range(8)]
    tier = make_tier(root, rows, BB, max_bytes=64 * ENTRY)
    try:
        direct_io = tier.direct_io
        fill(rows, range(8), keys, BB)
        assert store(tier, keys, list(range(8))).success
    finally:
        tier.shutdown()
    _fill_up(small_fs / "filler")

    tier = make_tier(root, rows, BB, max_bytes=64 * ENTRY)  # failed with OSError ENOSPC before the fix
    try:
        # The O_DIRECT probe could not write its page: not a reason to read buffered all run.
        assert tier.direct_io is direct_io, tier.direct_io_reason
        rows[8:16] = 0
        assert load(tier, keys, list(range(8, 16))).success
        for slot, key in zip(range(8, 16), keys, strict=True):
            assert np.array_equal(rows[slot, :BB], block_bytes_for(key, BB))
        if direct_io:  # direct_io=true was refused on the full disk ("O_DIRECT I/O failed: No space left")
            make_tier(root, AlignedRows(2, BB).rows, BB, max_bytes=64 * ENTRY, direct_io=True).shutdown()
        (small_fs / "filler").unlink()
        more = [key_of(i) for i in range(8, 10)]
        fill(rows, [16, 17], more, BB)
        assert store(tier, more, [16, 17]).success
        rows[16:18] = 0
        assert load(tier, more, [16, 17]).success
        assert all(np.array_equal(rows[s, :BB], block_bytes_for(k, BB)) for s, k in zip([16, 17], more, strict=True))
    finally:
        tier.shutdown()
    ns_dir = next(p for p in root.iterdir() if p.is_dir())
    # The restarted tier published its count once the disk had room (an instance that never had
    # room to write its first record left an empty ledger, which reads as 0: it added nothing).
    sizes = sorted(p.stat().st_size for p in (ns_dir / "ledger").iterdir())
    assert set(sizes) <= {0, 32} and sizes[-1] == 32, sizes


@pytest.mark.parametrize(
    "changes",
    [{"value_format_version": 3}, {"value_format_version": True}, {"kvtier_fs_layout": 2}, {"payload_offset": 8192}],
)
def test_inspect_reports_a_manifest_the_tier_refuses(
    tmp_path: Path, rows: np.ndarray, changes: dict[str, object]
) -> None:
    """docs/tiers.md: a manifest naming a format this release cannot read keeps the tier out of the
    namespace "and `kvtier inspect` reports it". The fs tier refused such a namespace at start
    while ``inspect`` called it fine (exit 0) and, with ``--remove-corrupt``, judged its values by
    the layout this release writes."""
    import json

    from kvtier.errors import ConfigError
    from kvtier.tiers.fs import verify_root

    store_three(tmp_path, rows, BB, b"format")
    (manifest_path,) = tmp_path.glob("*/manifest.json")
    manifest_path.write_text(json.dumps({**json.loads(manifest_path.read_text()), **changes}))
    with pytest.raises(ConfigError):
        make_tier(tmp_path, rows, BB)
    values = sorted(tmp_path.glob("*/*/*.kv"))
    broken = bytearray(values[0].read_bytes())
    broken[-1] ^= 1
    values[0].write_bytes(broken)

    report = verify_root(tmp_path, check_payloads=True, remove_corrupt=True)
    (ns,) = report.namespaces
    field = next(iter(changes))
    assert ns.manifest_error is not None and f"{field}=" in ns.manifest_error, ns.manifest_error
    assert not report.ok and ns.removed_corrupt == 0 and sorted(tmp_path.glob("*/*/*.kv")) == values


def test_inspect_takes_an_older_value_format_the_tier_reads(tmp_path: Path, rows: np.ndarray) -> None:
    import json

    from kvtier.tiers.fs import verify_root

    keys = [key_of(i, b"older") for i in range(2)]
    fill(rows, range(2), keys, BB)
    tier = make_tier(tmp_path, rows, BB)
    try:
        assert store(tier, keys, [0, 1]).success
    finally:
        tier.shutdown()
    (manifest_path,) = tmp_path.glob("*/manifest.json")
    manifest_path.write_text(json.dumps({**json.loads(manifest_path.read_text()), "value_format_version": 1}))
    report = verify_root(tmp_path, check_payloads=True)
    assert report.ok and report.namespaces[0].verified == 2, report.namespaces[0].manifest_error


def test_a_read_only_root_is_refused_naming_the_directory_not_a_temp_name(small_fs: Path, rows: np.ndarray) -> None:
    """An engine restarted on a root that is now read-only (a remount after errors, a read-only
    volume) got a bare ``OSError: [Errno 30] Read-only file system: '8558-54fba3d36d7b'`` (its new
    temp directory's name) from ``TieringManager.create``, and ``kvtier bench --fs-root`` printed
    that name as the culprit. It is a ConfigError naming the namespace directory and the fix."""
    from kvtier.errors import ConfigError

    root = small_fs / "kv"
    make_tier(root, rows, BB).shutdown()
    (ns_dir,) = root.iterdir()
    before = sorted(p.name for p in ns_dir.rglob("*"))
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    try:
        with pytest.raises(ConfigError) as refused:
            make_tier(root, rows, BB)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    text = str(refused.value)
    assert str(ns_dir) in text and "Read-only file system" in text and "writable" in text, text
    assert sorted(p.name for p in ns_dir.rglob("*")) == before


def _obey_file_modes(monkeypatch: pytest.MonkeyPatch, module: object) -> None:
    """As root (CAP_DAC_OVERRIDE), make ``module``'s opens fail on a file without read bits as
    they do for every other user, so the tests check the same thing as root and as a user."""
    import stat

    if os.geteuid() != 0:
        return
    real = module.open_regular  # type: ignore[attr-defined]

    def open_regular(path: str, flags: int, **kwargs: object) -> int:
        st = os.stat(path, dir_fd=kwargs.get("dir_fd"), follow_symlinks=False)  # type: ignore[arg-type]
        if stat.S_ISREG(st.st_mode) and not st.st_mode & 0o444:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path, flags, **kwargs)

    monkeypatch.setattr(module, "open_regular", open_regular)


def test_a_value_file_this_user_may_not_read_is_an_unsafe_entry_not_an_io_error(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value file of a wrong mode (a share_group member's 0600 file, a file made 0000) failed
    every load as an I/O error of the medium: it stayed a HIT for ever, and a few in a row opened
    the breaker, taking the whole tier out of service. It is an unsafe entry: not served, counted,
    a MISS from then on, left in place; the breaker stays closed."""
    from kvtier.tiers import fs_files
    from kvtier.types import LookupResult

    _obey_file_modes(monkeypatch, fs_files)
    keys = [key_of(i, b"mode") for i in range(6)]
    fill(rows, range(6), keys, BB)
    tier = make_tier(tmp_path, rows, BB)
    try:
        assert store(tier, keys, list(range(6))).success
    finally:
        tier.shutdown()
    locked = keys[:5]
    paths = {p.name: p for p in tmp_path.glob("*/*/*.kv")}
    for key in locked:
        paths[f"{key.hex()}.kv"].chmod(0)
    tier = make_tier(tmp_path, rows, BB, failure_threshold=2)
    try:
        for key in locked:
            assert tier.lookup(key, None) is LookupResult.HIT
            assert not load(tier, [key], [8]).success
            assert tier.lookup(key, None) is LookupResult.MISS
        assert tier.health().state.name == "CLOSED", tier.health()
        assert tier.stats.extra["io_errors"] == 0 and tier.stats.extra["unsafe_entries"] == len(locked)
        rows[9] = 0
        assert load(tier, [keys[5]], [9]).success and np.array_equal(rows[9, :BB], block_bytes_for(keys[5], BB))
    finally:
        tier.shutdown()
    assert all(paths[f"{key.hex()}.kv"].exists() for key in locked), "never deleted"


def test_a_journal_this_user_may_not_read_hides_no_other_engines_blocks(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A journal segment of a wrong mode in ``journal/`` made every journal read raise: the
    records already read from the other engines' journals were dropped with it (their cursors had
    moved on: lost for good), so this engine never learnt another engine's blocks, and
    "housekeeping failed" was logged every 50 ms. It is skipped, logged once."""
    import logging
    import time

    from kvtier.tiers import fs_journal
    from kvtier.tiers.fs_journal import ADDED, pack_entry
    from kvtier.types import LookupResult

    _obey_file_modes(monkeypatch, fs_journal)
    reader = make_tier(tmp_path, rows, BB)
    other_rows = AlignedRows(4, BB).rows
    writer = make_tier(tmp_path, other_rows, BB)
    try:
        (ns_dir,) = tmp_path.iterdir()
        planted = ns_dir / "journal" / "123-abcdefabcdef.1"
        planted.write_bytes(pack_entry(ADDED, key_of(99, b"planted"), time.time()))
        planted.chmod(0)
        key = key_of(0, b"journal")
        fill(other_rows, [0], [key], BB)
        with caplog.at_level(logging.WARNING):
            assert store(writer, [key], [0]).success
            deadline = time.monotonic() + 10
            while reader.lookup(key, None) is not LookupResult.HIT and time.monotonic() < deadline:
                reader.on_schedule_end()
                time.sleep(0.02)
            assert reader.lookup(key, None) is LookupResult.HIT
        assert not any("housekeeping failed" in r.getMessage() for r in caplog.records)
        # Once per engine that follows the journals (both tiers here), not once per read.
        assert 1 <= sum("journal/123-abcdefabcdef.1" in r.getMessage() for r in caplog.records) <= 2
    finally:
        writer.shutdown()
        reader.shutdown()


def test_inspect_lists_a_value_it_cannot_read_as_unreadable_not_corrupt(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``NamespaceReport.unreadable``: "Entries whose read failed ...: not checked, kept, not
    counted as corrupt". The fs inspect counted a value it could not read (EACCES, EIO) as
    corrupt, in the corrupt total and list."""
    from kvtier.tiers import fs_layout
    from kvtier.tiers.fs import verify_root

    _obey_file_modes(monkeypatch, fs_layout)
    store_three(tmp_path, rows, BB, b"unreadable")
    locked = sorted(tmp_path.glob("*/*/*.kv"))[0]
    locked.chmod(0)
    report = verify_root(tmp_path, check_payloads=True, remove_corrupt=True)
    (ns,) = report.namespaces
    assert not ns.corrupt and report.corrupt == 0 and ns.verified == 2
    assert [u.path for u in ns.unreadable] == [str(locked)] and "Permission denied" in ns.unreadable[0].reason
    assert not report.ok and locked.exists()


def test_an_instance_directory_this_user_cannot_open_is_not_taken_for_dead(tmp_path: Path, rows: np.ndarray) -> None:
    """``instance_alive`` took an instance directory it could not open (EACCES: a share_group
    member's directory of a wrong mode) for a dead instance's: another engine then adopted (renamed
    away) that live engine's ledger, whose counts were never published again, and deleted its
    journal. Not proven dead, it is alive; a missing one is still dead."""
    import shutil
    import sys

    tier = make_tier(tmp_path, rows, BB)
    (ns_dir,) = tmp_path.iterdir()
    (instance,) = (ns_dir / "tmp").iterdir()
    code = (
        "import pathlib, sys; from kvtier.tiers.fs_layout import instance_alive; "
        "print(instance_alive(pathlib.Path(sys.argv[1]), sys.argv[2]), instance_alive(pathlib.Path(sys.argv[1]), "
        "'1-000000000000'))"
    )
    command = [sys.executable, "-c", code, str(ns_dir), instance.name]
    if os.geteuid() == 0:  # root reads any directory: check as root without CAP_DAC_OVERRIDE
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to drop root's capabilities")
        command = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", *command]
    instance.chmod(0)
    try:
        found = subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()
    finally:
        instance.chmod(0o700)
        tier.shutdown()
    assert found == ["True", "False"]
