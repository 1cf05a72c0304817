"""An fs namespace directory's identity (``store-id``) and the store location it gives.

Regression (review, 2026-12-06): the fleet's store id of an fs tier was ``fs:<real path of the
root>`` and the namespace, so two hosts each with its own NVMe mounted at one path
(``/mnt/nvme/kvtier``) announced one store, and ``kvtier fleet serve`` reported blocks an
engine's disk did not hold. The location now carries the namespace directory's identity, made
once (race-free) by the first engine to adopt the directory: engines that see one directory
agree, a directory at the same path elsewhere (or made anew) is another store. A Redis on
loopback or a unix socket is each host's own: its location names the host.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
from fs_helpers import AlignedRows, fill, key_of, load, make_tier, namespace, store

from kvtier.engine_events import store_id
from kvtier.errors import ConfigError
from kvtier.tiers.fs import FilesystemTier, verify_root
from kvtier.tiers.redis import RedisTier, RedisTierOptions

BB = 16 * 1024
STORE_ID = "store-id"
IS_ROOT = os.geteuid() == 0


@pytest.fixture
def rows() -> np.ndarray:
    return AlignedRows(16, BB).rows


def _location(root: Path, rows: np.ndarray) -> tuple[str, Path]:
    tier = make_tier(root, rows, BB)
    try:
        return tier.store_location(), tier.ns_dir
    finally:
        tier.shutdown()


def _identity_in(ns_dir: Path) -> str:
    text = (ns_dir / STORE_ID).read_text()
    assert re.fullmatch(r"[0-9a-f]{32}\n", text), text
    return text[:32]


def test_the_identity_is_made_once_and_survives_a_restart(tmp_path: Path, rows: np.ndarray) -> None:
    first, ns_dir = _location(tmp_path, rows)
    identity = _identity_in(ns_dir)
    assert first == f"fs:{os.path.realpath(tmp_path)}#{identity}"
    again, _ = _location(tmp_path, rows)
    assert again == first and _identity_in(ns_dir) == identity
    mode = stat.S_IMODE((ns_dir / STORE_ID).stat().st_mode)
    assert mode == 0o600, oct(mode)


def test_a_new_directory_at_the_same_path_is_another_store(tmp_path: Path, rows: np.ndarray) -> None:
    """Each host's local disk at one mount path: same root path, another directory. Simulated by
    moving the namespace directory away (it stays for the other "host") and starting again."""
    first, ns_dir = _location(tmp_path, rows)
    ns_dir.rename(tmp_path / "other-host")
    second, _ = _location(tmp_path, rows)
    assert second.split("#")[0] == first.split("#")[0]  # the same path ...
    assert second != first  # ... but another store
    hexdigest = namespace(BB).hexdigest
    assert store_id(second, hexdigest) != store_id(first, hexdigest)
    # The first directory back in place: its identity came along with it.
    shutil.rmtree(ns_dir)
    (tmp_path / "other-host").rename(ns_dir)
    assert _location(tmp_path, rows)[0] == first


def test_engines_adopting_a_new_directory_at_once_agree(tmp_path: Path, rows: np.ndarray) -> None:
    """Tiers started together on one new root (threads released by a barrier) all read one identity."""
    n = 6
    barrier = threading.Barrier(n)
    locations: list[str] = []
    errors: list[BaseException] = []
    tiers: list[FilesystemTier] = []
    lock = threading.Lock()

    def start() -> None:
        try:
            barrier.wait(timeout=30)
            tier = make_tier(tmp_path, AlignedRows(4, BB).rows, BB)
            with lock:
                tiers.append(tier)
                locations.append(tier.store_location())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert not errors, errors
        assert len(locations) == n and len(set(locations)) == 1, locations
        assert locations[0].endswith("#" + _identity_in(tiers[0].ns_dir))
    finally:
        for tier in tiers:
            tier.shutdown()


def test_an_engine_that_loses_the_race_takes_the_winners_identity(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deterministic: another engine links its identity in between this one's read (none there)
    and its link; the link fails (never replaces) and the winner's identity is read."""
    winner = "0123456789abcdef" * 2
    real_link = os.link
    raced: list[str] = []

    def link_after_the_winner(src: str, dst: str, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None,
                              follow_symlinks: bool = True) -> None:  # fmt: skip
        if dst == STORE_ID and not raced:
            raced.append(dst)
            fd = os.open(STORE_ID, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dst_dir_fd)
            os.write(fd, (winner + "\n").encode())
            os.close(fd)
        real_link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=follow_symlinks)

    monkeypatch.setattr(os, "link", link_after_the_winner)
    tier = make_tier(tmp_path, rows, BB)
    try:
        assert raced, "the identity was not linked into place"
        assert tier.store_location() == f"fs:{os.path.realpath(tmp_path)}#{winner}"
        assert _identity_in(tier.ns_dir) == winner
        (instance,) = (tier.ns_dir / "tmp").iterdir()
        assert sorted(p.name for p in instance.iterdir()) == ["lock"]  # the loser's temp file is gone
    finally:
        tier.shutdown()


def test_two_processes_adopting_a_new_root_at_once_agree(tmp_path: Path) -> None:
    """Two engine processes on one new root, started at the same moment (a file they both wait for)."""
    go = tmp_path / "go"
    child = f"""
import os, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from fs_helpers import AlignedRows, make_tier
while not os.path.exists({str(go)!r}):
    time.sleep(0.001)
tier = make_tier({str(tmp_path / "root")!r}, AlignedRows(4, {BB}).rows, {BB})
print(tier.store_location())
tier.shutdown()
"""
    procs = [subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(0.5)
    go.touch()
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert outs[0] == outs[1] and "#" in outs[0], outs


def _planted(ns_dir: Path, kind: str, victim: Path) -> None:
    path = ns_dir / STORE_ID
    if kind == "symlink":
        path.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "garbage":
        path.write_bytes(b"not an identity at all\n")
    elif kind == "short":
        path.write_text("0123456789abcdef0123456789abcde\n")  # 31 digits
    elif kind == "long":
        path.write_text("0123456789abcdef0123456789abcdef0\n")  # 33 digits
    elif kind == "upper":
        path.write_text("0123456789ABCDEF0123456789ABCDEF\n")
    elif kind == "no-newline":  # the start of one, never finished: waited for (2 s), then refused
        path.write_text("0123456789abcdef0123456789abcdef")
    elif kind == "directory":
        path.mkdir()
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "garbage", "short", "long", "upper", "no-newline", "directory"])
def test_a_planted_identity_is_refused_never_followed_nor_removed(tmp_path: Path, rows: np.ndarray, kind: str) -> None:
    root = tmp_path / "root"
    _, ns_dir = _location(root, rows)
    (ns_dir / STORE_ID).unlink()
    victim = tmp_path / "victim"
    victim.write_text("0123456789abcdef" * 2 + "\n")  # a valid identity: following the link would take it
    _planted(ns_dir, kind, victim)
    before = os.lstat(ns_dir / STORE_ID)
    started = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        make_tier(root, rows, BB).shutdown()
    assert time.monotonic() - started < 20  # a FIFO blocks nothing
    message = str(refused.value)
    assert str(ns_dir / STORE_ID) in message and "Remove it" in message, message
    after = os.lstat(ns_dir / STORE_ID)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)  # neither removed nor replaced
    assert victim.read_text() == "0123456789abcdef" * 2 + "\n"
    report = verify_root(root)  # inspect names it, and leaves it
    (ns,) = report.namespaces
    assert [c.path for c in ns.unsafe_entries] == [str(ns_dir / STORE_ID)]
    assert "engines refuse the directory" in ns.unsafe_entries[0].reason
    assert str(ns_dir / STORE_ID) not in ns.foreign_files
    assert os.lstat(ns_dir / STORE_ID).st_ino == before.st_ino
    (ns_dir / STORE_ID).rmdir() if kind == "directory" else (ns_dir / STORE_ID).unlink()
    _location(root, rows)  # removed, as the message says: the next engine makes a new one
    _identity_in(ns_dir)


@pytest.mark.skipif(not IS_ROOT, reason="needs root to give the file to another user")
def test_an_identity_of_another_user_is_refused(tmp_path: Path, rows: np.ndarray) -> None:
    _, ns_dir = _location(tmp_path, rows)
    os.chown(ns_dir / STORE_ID, 54321, 54321)
    with pytest.raises(ConfigError, match=r"not a regular file of ours.*owned by uid 54321"):
        make_tier(tmp_path, rows, BB).shutdown()
    assert (ns_dir / STORE_ID).stat().st_uid == 54321


def test_inspect_takes_the_identity_for_the_tiers_own(tmp_path: Path, rows: np.ndarray) -> None:
    """``kvtier inspect`` lists no foreign file for it, reports nothing unsafe, and
    ``--verify --remove-corrupt`` leaves it in place."""
    tier = make_tier(tmp_path, rows, BB)
    try:
        keys = [key_of(i, b"inspect") for i in range(3)]
        fill(rows, range(3), keys, BB)
        assert store(tier, keys, range(3)).success
        ns_dir = tier.ns_dir
    finally:
        tier.shutdown()
    identity = _identity_in(ns_dir)
    report = verify_root(tmp_path, remove_corrupt=True)
    (ns,) = report.namespaces
    assert ns.foreign_files == [] and ns.unsafe_entries == [] and ns.ok and ns.entries == 3
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "inspect", str(tmp_path), "--verify", "--remove-corrupt"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "foreign" not in out.stdout and "unsafe" not in out.stdout, out.stdout
    assert _identity_in(ns_dir) == identity


def test_a_directory_of_an_older_release_gets_an_identity_and_stays_warm(tmp_path: Path, rows: np.ndarray) -> None:
    """A namespace directory written before identities (manifest and values, no ``store-id``)
    is given one by the first engine of this release to adopt it; its values are served."""
    tier = make_tier(tmp_path, rows, BB)
    try:
        keys = [key_of(i, b"older") for i in range(4)]
        fill(rows, range(4), keys, BB)
        assert store(tier, keys, range(4)).success
        ns_dir = tier.ns_dir
    finally:
        tier.shutdown()
    (ns_dir / STORE_ID).unlink(missing_ok=True)  # as the older release left it
    tier = make_tier(tmp_path, rows, BB)
    try:
        identity = _identity_in(ns_dir)
        assert tier.store_location() == f"fs:{os.path.realpath(tmp_path)}#{identity}"
        rows[8:12] = 0
        assert load(tier, keys, range(8, 12)).success and np.array_equal(rows[8:12], rows[0:4])
    finally:
        tier.shutdown()


def test_a_root_without_hard_links_gets_an_identity_in_place(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vfat, some FUSE and SMB mounts: ``link`` fails with EPERM; the identity is created in place
    (exclusively) instead, and read back the same by the next start."""

    def no_links(*args: object, **kwargs: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    first, ns_dir = _location(tmp_path, rows)
    identity = _identity_in(ns_dir)
    assert first.endswith("#" + identity)
    assert _location(tmp_path, rows)[0] == first


# --- Redis ------------------------------------------------------------------------------------


def _redis_location(url: str, prefix: str = "p") -> str:
    unbuilt = types.SimpleNamespace(options=RedisTierOptions(url=url, prefix=prefix))  # nothing connects
    return RedisTier.store_location(unbuilt)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "server"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379"),
        ("redis://127.0.0.2/0", "redis://127.0.0.2:6379"),
        ("redis://localhost:7000", "redis://localhost:7000"),
        ("redis://[::1]:6380/0", "redis://[::1]:6380"),
        ("rediss://0.0.0.0:6379/0", "rediss://0.0.0.0:6379"),
        ("unix:///run/redis/redis.sock?db=0", "unix:///run/redis/redis.sock"),
    ],
)
def test_a_host_local_redis_names_the_host(url: str, server: str) -> None:
    """Each host's own Redis at 127.0.0.1 is its own store: the location names the host."""
    assert _redis_location(url) == f"redis:{server}/0/p#host={socket.gethostname()}"


@pytest.mark.parametrize("url", ["redis://10.0.0.9:6379/0", "redis://redis.example:6379/0", "redis://[fd00::9]:6379/0"])
def test_a_redis_other_hosts_reach_is_named_alike_everywhere(url: str) -> None:
    assert _redis_location(url) == f"redis:{url[: url.rindex('/')]}/0/p"
