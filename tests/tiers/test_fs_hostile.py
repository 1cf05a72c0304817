"""The fs tier's root is untrusted content (issue 9, item 3): real files, FIFOs, symlinks and
other users' files planted where values live; two processes sharing one root."""

from __future__ import annotations

import grp
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash
from fs_helpers import AlignedRows, fill, key_of, load, make_tier, store

from kvtier.errors import ConfigError
from kvtier.tiers.fs import verify_root
from kvtier.tiers.fs_layout import PAYLOAD_OFFSET, entry_bytes, value_path
from kvtier.types import LookupResult

BB = 16 * 1024
ENTRY = entry_bytes(BB)
IS_ROOT = os.geteuid() == 0


@pytest.fixture
def rows() -> Iterator[np.ndarray]:
    aligned = AlignedRows(16, BB)
    yield aligned.rows


def _ns_dir(root: Path, rows: np.ndarray) -> Path:
    """Create (and shut down) a tier once so the namespace directory exists; returns it."""
    tier = make_tier(root, rows, BB)
    ns_dir = tier.ns_dir
    tier.shutdown()
    return ns_dir


def _unblock_fifo(path: Path) -> None:
    """Release any reader stuck in open() on a FIFO (the old code blocked there)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    os.close(fd)


# --- symlinks ----------------------------------------------------------------------------------


def test_a_symlink_named_like_a_value_is_never_followed_served_or_recycled(tmp_path: Path, rows: np.ndarray) -> None:
    """A symlink named like a value and pointing outside the root used to get its *target*
    overwritten when its entry was evicted and its file recycled."""
    root = tmp_path / "root"
    ns_dir = _ns_dir(root, rows)
    victim = tmp_path / "precious.txt"
    victim.write_bytes(b"do not overwrite me")
    planted = key_of(99, b"link")
    link = value_path(ns_dir, planted)
    link.symlink_to(victim)
    os.utime(link, (1, 1), follow_symlinks=False)  # the oldest entry: the first to be evicted

    tier = make_tier(root, rows, BB, max_bytes=2 * ENTRY)
    try:
        assert tier.lookup(planted, None) is LookupResult.MISS, "a symlink must never be indexed"
        keys = [key_of(i, b"fresh") for i in range(4)]
        fill(rows, range(4), keys, BB)
        for i, key in enumerate(keys):
            assert store(tier, [key], [i]).success
        assert tier.stats.extra["unsafe_entries"] >= 1
    finally:
        tier.shutdown()
    assert victim.read_bytes() == b"do not overwrite me"
    assert link.is_symlink(), "kvtier never deletes what it did not prove is its own file"


def test_a_value_swapped_for_a_symlink_after_indexing_is_not_followed(tmp_path: Path, rows: np.ndarray) -> None:
    root = tmp_path / "root"
    victim = tmp_path / "secret.txt"
    victim.write_bytes(b"s" * (PAYLOAD_OFFSET + BB))
    tier = make_tier(root, rows, BB, max_bytes=2 * ENTRY)
    try:
        keys = [key_of(i, b"swap") for i in range(3)]
        fill(rows, range(3), keys, BB)
        assert store(tier, keys[:1], [0]).success
        path = value_path(tier.ns_dir, keys[0])
        path.unlink()
        path.symlink_to(victim)
        rows[5] = 0
        result = load(tier, keys[:1], [5])
        assert not result.success and tier.stats.corrupt_values == 0
        assert not rows[5].any(), "nothing read through the symlink"
        # evicting and recycling it must not write through it either
        assert store(tier, keys[1:3], [1, 2]).success
    finally:
        tier.shutdown()
    assert victim.read_bytes() == b"s" * (PAYLOAD_OFFSET + BB)


@pytest.mark.parametrize("swap", ["symlink", "fifo"])
def test_a_shard_swapped_for_a_link_or_a_fifo_is_an_unsafe_entry_not_an_io_failure(
    tmp_path: Path, rows: np.ndarray, swap: str
) -> None:
    """Regression (review, 2026-12-02): a shard directory replaced by a symlink counted as an I/O
    error on every load and store (five took the whole tier out of service), and the key kept
    answering HIT. (A regular file there is the medium failing, the conformance suite's outage.)"""
    import shutil

    from kvtier.tiers.base import HealthState

    root = tmp_path / "root"
    tier = make_tier(root, rows, BB)
    try:
        first: dict[int, bytes] = {}
        for i in range(2000):  # two keys of one shard
            key = key_of(i, b"shard")
            if key[0] in first:
                keys = [first[key[0]], key]
                break
            first[key[0]] = key
        fill(rows, range(2), keys, BB)
        assert store(tier, keys[:1], [0]).success
        shard = value_path(tier.ns_dir, keys[0]).parent
        elsewhere = tmp_path / "elsewhere"
        shutil.move(shard, elsewhere)
        if swap == "symlink":
            shard.symlink_to(elsewhere)
        else:
            os.mkfifo(shard)
        rows[5] = 0
        for _ in range(6):
            result = load(tier, keys[:1], [5])
            assert not result.success
        assert not rows[5].any(), "nothing read through the link"
        assert tier.lookup(keys[0], None) is LookupResult.MISS, "an unsafe key is forgotten"
        for _ in range(6):  # a store into that shard: refused, left alone
            assert not store(tier, keys[1:], [1]).success
        extra = tier.stats.extra
        assert extra["io_errors"] == 0 and extra["unsafe_entries"] >= 2
        assert tier.health().state is HealthState.CLOSED
    finally:
        tier.shutdown()
    assert sorted(p.name for p in elsewhere.iterdir()) == [value_path(tier.ns_dir, keys[0]).name]


# --- FIFOs --------------------------------------------------------------------------------------


def test_a_fifo_named_like_a_value_never_blocks_a_load_or_the_shutdown(tmp_path: Path, rows: np.ndarray) -> None:
    """A FIFO named like a value left a lookup HIT_PENDING forever (its load blocked in open())
    and made every later shutdown() fail ("threads did not stop")."""
    root = tmp_path / "root"
    ns_dir = _ns_dir(root, rows)
    planted = key_of(7, b"fifo")
    fifo = value_path(ns_dir, planted)
    os.mkfifo(fifo)
    tier = make_tier(root, rows, BB, shutdown_timeout=2)
    try:
        assert tier.lookup(planted, None) is LookupResult.MISS
        result = load(tier, [planted], [0], timeout=5)
        assert not result.success
        # the race: a regular value indexed, then swapped for a FIFO
        key = key_of(8, b"fifo")
        fill(rows, [1], [key], BB)
        assert store(tier, [key], [1]).success
        path = value_path(tier.ns_dir, key)
        path.unlink()
        os.mkfifo(path)
        result = load(tier, [key], [2], timeout=5)
        assert not result.success and tier.stats.extra["unsafe_entries"] >= 1
        assert stat.S_ISFIFO(path.lstat().st_mode), "not ours to delete"
    finally:
        try:
            tier.shutdown()  # must not raise "threads did not stop"
        finally:
            for p in ns_dir.rglob("*.kv"):
                if stat.S_ISFIFO(p.lstat().st_mode):
                    _unblock_fifo(p)
    assert fifo.exists()


# --- corrupt and foreign values -----------------------------------------------------------------


def _rewrite_header(path: Path, **changes: object) -> None:
    """Rewrite fields of a format-1 header in place and fix its header checksum."""
    raw = bytearray(path.read_bytes())
    if "namespace" in changes:
        raw[16:32] = changes["namespace"]  # type: ignore[index]
    if "key" in changes:
        raw[32:64] = changes["key"]  # type: ignore[index]
    if "payload_len" in changes:
        struct.pack_into("<Q", raw, 72, changes["payload_len"])
    struct.pack_into("<Q", raw, 88, xxhash.xxh3_64_intdigest(bytes(raw[:88])))
    path.write_bytes(bytes(raw))


DAMAGE = {
    "declared_longer_than_the_block": lambda p: _rewrite_header(p, payload_len=BB * 4),
    "other_namespace": lambda p: _rewrite_header(p, namespace=bytes(16)),
    "other_key": lambda p: _rewrite_header(p, key=b"\x01" * 32),
    "truncated": lambda p: os.truncate(p, PAYLOAD_OFFSET + BB // 2),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("owner", ["ours", "foreign"])
def test_a_bad_value_is_a_counted_miss_and_removed_only_if_ours(
    tmp_path: Path, rows: np.ndarray, damage: str, owner: str
) -> None:
    if owner == "foreign" and not IS_ROOT:
        pytest.skip("making a file of another user needs root")
    tier = make_tier(tmp_path, rows, BB, direct_io=False)
    try:
        key = key_of(1, damage.encode())
        fill(rows, [0], [key], BB)
        assert store(tier, [key], [0]).success
        path = value_path(tier.ns_dir, key)
        DAMAGE[damage](path)
        if owner == "foreign":
            os.chown(path, 65534, 65534)
        rows[1] = 0
        result = load(tier, [key], [1])
        assert not result.success and tier.lookup(key, None) is LookupResult.MISS
        if owner == "ours":
            assert tier.stats.corrupt_values == 1
            assert not path.exists(), "a corrupt regular file of ours is removed"
        else:
            assert tier.stats.extra["unsafe_entries"] == 1
            assert path.exists(), "another user's file is never removed"
    finally:
        tier.shutdown()


# --- modes ---------------------------------------------------------------------------------------


def _modes(root: Path) -> tuple[set[int], set[int]]:
    dirs = {stat.S_IMODE(p.lstat().st_mode) for p in root.rglob("*") if p.is_dir()}
    files = {stat.S_IMODE(p.lstat().st_mode) for p in root.rglob("*") if p.is_file()}
    return dirs, files


def test_files_and_directories_are_private_by_default(tmp_path: Path, rows: np.ndarray) -> None:
    old = os.umask(0o022)
    try:
        tier = make_tier(tmp_path / "root", rows, BB)
        try:
            fill(rows, [0], [key_of(1)], BB)
            assert store(tier, [key_of(1)], [0]).success
            dirs, files = _modes(tier.ns_dir)
            assert stat.S_IMODE(tier.ns_dir.lstat().st_mode) == 0o700
        finally:
            tier.shutdown()
    finally:
        os.umask(old)
    assert dirs == {0o700} and files == {0o600}, (dirs, files)


def test_a_missing_root_and_its_parents_are_made_private_and_an_existing_one_is_left_alone(
    tmp_path: Path, rows: np.ndarray
) -> None:
    """Regression (review, 2026-12-03): the root and its missing parents were made 0755 (``mkdir -p``),
    so every user could list the namespace digests; the docs say the tier creates directories 0700."""
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o755)
    os.chmod(existing, 0o755)  # the user's own directory: kvtier never changes its mode
    old = os.umask(0o022)
    try:
        tier = make_tier(existing / "a" / "b" / "root", rows, BB)
        tier.shutdown()
    finally:
        os.umask(old)
    made = [existing / "a", existing / "a" / "b", existing / "a" / "b" / "root"]
    assert [oct(stat.S_IMODE(p.lstat().st_mode)) for p in made] == [oct(0o700)] * 3
    assert stat.S_IMODE(existing.lstat().st_mode) == 0o755


def test_a_missing_root_of_a_shared_group_is_the_groups(tmp_path: Path, rows: np.ndarray) -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    tier = make_tier(tmp_path / "a" / "root", rows, BB, share_group=group)
    tier.shutdown()
    for made in (tmp_path / "a", tmp_path / "a" / "root"):
        st = made.lstat()
        assert stat.S_IMODE(st.st_mode) == 0o2770 and st.st_gid == os.getgid(), (made, oct(st.st_mode))


def test_a_shared_group_gets_group_access(tmp_path: Path, rows: np.ndarray) -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    tier = make_tier(tmp_path / "root", rows, BB, share_group=group)
    try:
        fill(rows, [0], [key_of(1)], BB)
        assert store(tier, [key_of(1)], [0]).success
        dirs, files = _modes(tier.ns_dir)
        assert all(p.lstat().st_gid == os.getgid() for p in tier.ns_dir.rglob("*"))
    finally:
        tier.shutdown()
    assert dirs == {0o2770} and files == {0o640}, (dirs, files)
    with pytest.raises(ConfigError, match="share_group"):
        make_tier(tmp_path / "other", rows, BB, share_group="no-such-group-kvtier")


# --- construction failure -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{"max_bytes": 100}, {"read_threads": 0}, {"max_queued_stores": 0}, {"share_group": "no-such-group-kvtier"}],
)
def test_invalid_options_leave_no_temp_dir_and_no_lock(
    tmp_path: Path, rows: np.ndarray, options: dict, open_fds: Callable[[Path], list[str]]
) -> None:
    root = tmp_path / "root"
    _ns_dir(root, rows)  # the namespace directory exists; a failed start must add nothing to it
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with pytest.raises(ConfigError):
        make_tier(root, rows, BB, **options)
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    assert open_fds(root) == []


# --- inspect --------------------------------------------------------------------------------------


def test_inspect_reports_non_regular_entries_and_never_opens_them(tmp_path: Path, rows: np.ndarray) -> None:
    root = tmp_path / "root"
    tier = make_tier(root, rows, BB)
    try:
        fill(rows, [0], [key_of(1)], BB)
        assert store(tier, [key_of(1)], [0]).success
        ns_dir = tier.ns_dir
    finally:
        tier.shutdown()
    os.mkfifo(value_path(ns_dir, key_of(2)))
    value_path(ns_dir, key_of(3)).symlink_to(tmp_path / "elsewhere")
    done = threading.Event()
    result: list[object] = []

    def run() -> None:
        result.append(verify_root(root, check_payloads=True, remove_corrupt=True))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    finished = done.wait(20)
    if not finished:
        _unblock_fifo(value_path(ns_dir, key_of(2)))
    assert finished, "inspect blocked on a FIFO"
    (report,) = result
    (ns,) = report.namespaces  # type: ignore[attr-defined]
    assert ns.entries == 1 and ns.verified == 1 and not ns.corrupt
    reasons = {Path(e.path).name: e.reason for e in ns.unsafe_entries}
    assert reasons == {
        value_path(ns_dir, key_of(2)).name: "a FIFO",
        value_path(ns_dir, key_of(3)).name: "a symbolic link",
    }
    assert value_path(ns_dir, key_of(2)).exists() and value_path(ns_dir, key_of(3)).is_symlink()



# --- two engines sharing one root ----------------------------------------------------------------


def run_shared_root_race(root: Path, seconds: float, engines: int = 2, block_bytes: int = BB) -> list[dict]:
    """Run ``engines`` processes hammering one root; their counters (see fs_race_child.py)."""
    import json
    import subprocess
    import sys

    child = Path(__file__).with_name("fs_race_child.py")
    procs = [
        subprocess.Popen(
            [sys.executable, str(child), str(root), str(seed), str(seconds), str(block_bytes)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for seed in range(engines)
    ]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=seconds + 120)
        assert proc.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.slow
def test_two_engines_sharing_a_root_never_tear_or_lose_a_valid_value(tmp_path: Path) -> None:
    """Same keys, both evicting and recycling files the other may be reading: no wrong bytes,
    no value taken for corrupt (and so none deleted as corrupt), both actually raced."""
    # 3 engines, 64 KiB blocks, 8 s: the old code took 1 to 5 values for corrupt per run
    counters = run_shared_root_race(tmp_path / "root", seconds=8.0, engines=3, block_bytes=64 * 1024)
    for c in counters:
        assert c["wrong_bytes"] == 0, counters
        assert c["corrupt"] == 0, counters
        assert c["loads_ok"] > 0 and c["evictions"] > 0, counters


@pytest.mark.parametrize("what", ["file", "fifo", "dangling-link"])
def test_a_root_that_is_not_a_directory_is_named_so(tmp_path: Path, rows: np.ndarray, what: str) -> None:
    """Regression (review, 2026-12-02): a root that is a file, a FIFO or a dangling link was
    refused as 'not usable (File exists ...)'."""
    root = tmp_path / "root"
    if what == "file":
        root.write_text("x")
    elif what == "fifo":
        os.mkfifo(root)
    else:
        root.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="is not a directory"):
        make_tier(root, rows, BB)
    assert os.path.lexists(root) and not (tmp_path / "nowhere").exists()


def test_a_manifest_of_another_user_is_refused_and_left_as_it_is(tmp_path: Path, rows: np.ndarray) -> None:
    """Regression (review, 2026-12-06): the tier started on a manifest.json owned by another uid
    (every other file of the namespace is checked for its owner; the manifest was not)."""
    if not IS_ROOT:
        pytest.skip("making a file of another user needs root")
    ns_dir = _ns_dir(tmp_path, rows)
    manifest = ns_dir / "manifest.json"
    before = manifest.read_bytes()
    os.chown(manifest, 65534, 65534)
    with pytest.raises(ConfigError, match=r"manifest .* is not a regular file of ours \(owned by uid 65534"):
        make_tier(tmp_path, rows, BB)
    assert manifest.read_bytes() == before and manifest.stat().st_uid == 65534
    os.chown(manifest, os.geteuid(), os.getegid())
    make_tier(tmp_path, rows, BB).shutdown()  # ours again: the same directory starts
