"""Lock-held temporary directories: a dead creator's directory is swept, nothing else ever is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import kvtier.tempdir as tempdir_mod
from kvtier.tempdir import LOCK_NAME, LockedTempDir, sweep_stale_temp_dirs

PREFIX = "kvtier-bench-"


def _dead_creator_dir(parent: Path) -> Path:
    """A directory made by a process that was then killed with SIGKILL (its lock dropped by the kernel)."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from kvtier.tempdir import LockedTempDir
        d = LockedTempDir({PREFIX!r}, {str(parent)!r})
        (d.path / "payload").write_bytes(b"x" * 4096)
        print(d.path, flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    path = Path(proc.stdout.readline().strip())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    assert path.is_dir()
    return path


def test_a_live_dir_is_kept_and_removed_by_its_owner(tmp_path: Path) -> None:
    with LockedTempDir(PREFIX, tmp_path) as d:
        assert d.path.parent == tmp_path and (d.path / LOCK_NAME).is_file()
        assert oct(d.path.stat().st_mode & 0o777) == "0o700"
        assert sweep_stale_temp_dirs(PREFIX, tmp_path, remove=True) == []
        assert d.path.is_dir()
    assert not d.path.exists()
    d.cleanup()  # idempotent


def test_a_killed_creators_dir_is_listed_then_removed(tmp_path: Path) -> None:
    path = _dead_creator_dir(tmp_path)
    (found,) = sweep_stale_temp_dirs(PREFIX, tmp_path)
    assert found.path == path and found.size == 4096 and not found.removed and path.is_dir()
    (found,) = sweep_stale_temp_dirs(PREFIX, tmp_path, remove=True)
    assert found.removed and not path.exists()
    assert sweep_stale_temp_dirs(PREFIX, tmp_path, remove=True) == []


def test_a_dir_held_by_another_live_process_is_left_alone(tmp_path: Path) -> None:
    code = f"from kvtier.tempdir import LockedTempDir; import time; d = LockedTempDir({PREFIX!r}, {str(tmp_path)!r})"
    proc = subprocess.Popen([sys.executable, "-c", code + "; print(d.path, flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        path = Path(proc.stdout.readline().strip())
        assert sweep_stale_temp_dirs(PREFIX, tmp_path, remove=True) == []
        assert path.is_dir()
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def test_hostile_entries_are_never_followed_opened_or_deleted(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    victim = _dead_creator_dir(tmp_path / "elsewhere")  # stale and lockable: a sweep of "elsewhere" would take it
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    # A symlink with our prefix pointing at a stale (lockable) directory: not followed.
    (hostile / f"{PREFIX}link").symlink_to(victim)
    # A directory without a lock file, changed just now: not proven dead (it may be a creator's, before its lock).
    (hostile / f"{PREFIX}nolock").mkdir()
    (hostile / f"{PREFIX}nolock" / "data").write_text("keep")
    # A lock file that is a symlink to a real lock file elsewhere: not followed.
    (hostile / f"{PREFIX}linklock").mkdir()
    (hostile / f"{PREFIX}linklock" / LOCK_NAME).symlink_to(victim / LOCK_NAME)
    # A FIFO as the lock file: never opened in a blocking way, never deleted.
    (hostile / f"{PREFIX}fifo").mkdir()
    os.mkfifo(hostile / f"{PREFIX}fifo" / LOCK_NAME)
    # A plain file with our prefix.
    (hostile / f"{PREFIX}file").write_text("keep")
    # A directory of another uid (only possible to make as root).
    if os.getuid() == 0:
        other = hostile / f"{PREFIX}otheruid"
        other.mkdir()
        (other / LOCK_NAME).write_text("")
        os.chown(other / LOCK_NAME, 4242, 4242)
        os.chown(other, 4242, 4242)
    before = sorted(p.name for p in hostile.iterdir())
    started = time.monotonic()
    assert sweep_stale_temp_dirs(PREFIX, hostile, remove=True) == []
    assert time.monotonic() - started < 5
    assert sorted(p.name for p in hostile.iterdir()) == before
    assert victim.is_dir() and (hostile / f"{PREFIX}nolock" / "data").read_text() == "keep"


# A child that removes a directory the way the given mode does, with directory listings in sorted
# order (so the lock file, ".kvtier-lock", comes first: file systems may return any order) and a
# pause, announced with "paused", right after the removal unlinks the lock file while anything
# else is left, or once at most `keep` entries are left: the parent then kills it with SIGKILL.
_PAUSING_REMOVER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from kvtier.tempdir import LOCK_NAME, LockedTempDir, sweep_stale_temp_dirs

    mode, parent, keep = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    if mode == "cleanup":
        owned = LockedTempDir(sys.argv[4], parent)
        for i in range(int(sys.argv[5])):
            (owned.path / f"f{i:05d}").write_bytes(b"x")
        (owned.path / "sub").mkdir()
        (owned.path / "sub" / "inner").write_bytes(b"x")
        print(owned.path, flush=True)
        target = owned.path
    else:
        target = parent / sys.argv[4]
    real_scandir, real_listdir, real_unlink = os.scandir, os.listdir, os.unlink

    class SortedScandir:
        def __init__(self, *args, **kwargs):
            with real_scandir(*args, **kwargs) as it:
                self.entries = sorted(it, key=lambda e: e.name)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return None
        def __iter__(self):
            return iter(self.entries)
        def close(self):
            return None

    def unlink(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        names = real_listdir(target)
        if (names and LOCK_NAME not in names) or len(names) <= keep:
            print("paused", flush=True)
            time.sleep(600)

    os.scandir, os.unlink = SortedScandir, unlink
    if mode == "cleanup":
        owned.cleanup()
    else:
        sweep_stale_temp_dirs(sys.argv[5], parent, remove=True)
    print("done", flush=True)
    """
)


def _kill_remover_half_way(args: list[str]) -> list[str]:
    """Run the pausing remover with ``args``; SIGKILL it at its pause. Returns its lines before "paused"."""
    proc = subprocess.Popen([sys.executable, "-c", _PAUSING_REMOVER, *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    lines = []
    try:
        while (line := proc.stdout.readline().strip()) not in ("paused", "done", ""):
            lines.append(line)
        assert line == "paused", "the remover was to pause half way"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    return lines


def _fill(path: Path, files: int) -> None:
    for i in range(files):
        (path / f"f{i:05d}").write_bytes(b"x")
    (path / "sub").mkdir()
    (path / "sub" / "inner").write_bytes(b"x")


def test_a_sweep_killed_while_removing_leaves_the_lock_and_the_next_sweep_finishes(tmp_path: Path) -> None:
    path = _dead_creator_dir(tmp_path)
    _fill(path, 300)
    _kill_remover_half_way(["sweep", str(tmp_path), "100", path.name, PREFIX])
    left = {p.name for p in path.iterdir()}
    assert LOCK_NAME in left  # killed half way, the lock file still there: provably ours and dead
    assert 1 < len(left) <= 100 and "sub" in left
    (found,) = sweep_stale_temp_dirs(PREFIX, tmp_path, remove=True)
    assert found.path == path and found.removed and not path.exists()
    assert sweep_stale_temp_dirs(PREFIX, tmp_path, remove=True) == []


def test_an_owner_killed_inside_its_cleanup_is_swept(tmp_path: Path) -> None:
    (line,) = _kill_remover_half_way(["cleanup", str(tmp_path), "100", PREFIX, "300"])
    path = Path(line)
    left = {p.name for p in path.iterdir()}
    assert LOCK_NAME in left
    assert 1 < len(left) <= 100
    (found,) = sweep_stale_temp_dirs(PREFIX, tmp_path, remove=True)
    assert found.path == path and found.removed and not path.exists()


def test_an_old_empty_unlocked_dir_of_ours_is_swept_and_anything_else_unlocked_is_kept(tmp_path: Path) -> None:
    """A directory a killed remover left without its lock file (it goes after everything else) is
    empty, and dead after a while; only names mkdtemp makes are taken so (review, 2026-12-05: a
    user's own directory named with the prefix, say ``kvtier-replay-notes`` under a replay's
    --fs-root, would go too), and only empty ones (review, 2026-12-06: a user's
    ``kvtier-bench-baseline`` holding results, eight characters after the prefix like mkdtemp's,
    went with its files)."""
    old, fresh = tmp_path / f"{PREFIX}old12345", tmp_path / f"{PREFIX}fresh123"
    users, baseline = tmp_path / f"{PREFIX}notes", tmp_path / f"{PREFIX}baseline"
    fresh_empty = tmp_path / f"{PREFIX}new12345"  # empty and lock-less, but changed lately: kept
    old.mkdir(mode=0o700)
    fresh_empty.mkdir(mode=0o700)
    for path in (fresh, users, baseline):
        path.mkdir(mode=0o700)
        _fill(path, 20)
    long_ago = time.time() - tempdir_mod._STALE_UNLOCKED_DIR_SECONDS - 5
    for path in (old, users, baseline):
        os.utime(path, (long_ago, long_ago))
    (found,) = sweep_stale_temp_dirs(PREFIX, tmp_path)  # listing changes nothing
    assert found.path == old and found.size == 0 and not found.removed
    assert not (old / LOCK_NAME).exists() and os.stat(old).st_mtime == long_ago
    (found,) = sweep_stale_temp_dirs(PREFIX, tmp_path, remove=True)
    assert found.path == old and found.removed and not old.exists()
    assert len(list(fresh.iterdir())) == 21 and not (fresh / LOCK_NAME).exists()
    assert len(list(users.iterdir())) == 21, "a directory not named as mkdtemp names them is never taken"
    assert len(list(baseline.iterdir())) == 21, "an unlocked directory with anything in it is never taken"
    assert not (baseline / LOCK_NAME).exists()
    assert fresh_empty.is_dir() and not list(fresh_empty.iterdir()), "a directory changed lately is kept"


def test_a_claimed_lock_less_dir_written_to_since_it_was_found_empty_is_given_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (review, 2026-12-06): the sweep found a lock-less directory empty, then claimed
    it and emptied it: what was written in between went too. The claim is now withdrawn."""
    late = tmp_path / f"{PREFIX}late1234"
    late.mkdir(mode=0o700)
    long_ago = time.time() - tempdir_mod._STALE_UNLOCKED_DIR_SECONDS - 5
    os.utime(late, (long_ago, long_ago))
    real_claim = tempdir_mod._claim_unlocked

    def claim_after_a_write(dir_fd: int) -> int | None:
        (late / "results.csv").write_text("written after the check\n")
        return real_claim(dir_fd)

    monkeypatch.setattr(tempdir_mod, "_claim_unlocked", claim_after_a_write)
    assert sweep_stale_temp_dirs(PREFIX, tmp_path, remove=True) == []
    assert sorted(p.name for p in late.iterdir()) == ["results.csv"], "kept, without the sweeper's lock file"


def test_an_old_unlocked_dir_holding_only_a_creators_staging_lock_is_swept(tmp_path: Path) -> None:
    """A creator killed after making its lock file under the staging name, before publishing it,
    leaves that empty file: the directory is dead all the same. A file so named that is not empty
    is no staging lock: that directory is kept."""
    dead, other = tmp_path / f"{PREFIX}dead1234", tmp_path / f"{PREFIX}other123"
    for path in (dead, other):
        path.mkdir(mode=0o700)
    (dead / ".lock-4242-0123abcd").touch()
    (other / ".lock-4242-0123abcd").write_text("not a lock")
    long_ago = time.time() - tempdir_mod._STALE_UNLOCKED_DIR_SECONDS - 5
    for path in (dead, other):
        os.utime(path, (long_ago, long_ago))
    (found,) = sweep_stale_temp_dirs(PREFIX, tmp_path, remove=True)
    assert found.path == dead and found.removed and not dead.exists()
    assert (other / ".lock-4242-0123abcd").read_text() == "not a lock"


# A creator that stops (until a line on stdin) before its lock is in place: right after mkdtemp,
# or after locking its staging lock file; then prints the directory it finally got and lives on.
_STALLED_CREATOR = textwrap.dedent(
    """
    import fcntl, sys, tempfile, time
    from kvtier.tempdir import LockedTempDir

    stall_at, calls = sys.argv[1], []
    real_mkdtemp, real_flock = tempfile.mkdtemp, fcntl.flock

    def stall(name):
        calls.append(name)
        if calls.count(name) == 1 and name == stall_at:
            print(made[0], flush=True)
            sys.stdin.readline()

    made = []
    def mkdtemp(*args, **kwargs):
        made.append(real_mkdtemp(*args, **kwargs))
        stall("mkdtemp")
        return made[-1]

    def flock(*args):
        real_flock(*args)
        stall("flock")

    tempfile.mkdtemp, fcntl.flock = mkdtemp, flock
    owned = LockedTempDir(sys.argv[2], sys.argv[3])
    print(owned.path, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("stall_at", ["mkdtemp", "flock"])
@pytest.mark.parametrize("resume", ["after_sweep", "during_sweep"])
def test_a_creator_stalled_before_its_lock_never_loses_its_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stall_at: str, resume: str
) -> None:
    """A sweep may claim an old lock-less directory a stalled creator made; the creator then gets another.

    ``during_sweep`` resumes the creator once the sweep has claimed the directory (created the lock
    file) and before it deletes anything: the creator must not take it back.
    """
    proc = subprocess.Popen([sys.executable, "-c", _STALLED_CREATOR, stall_at, PREFIX, str(tmp_path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    final: list[Path] = []

    def resume_creator() -> None:
        assert proc.stdin is not None and proc.stdout is not None
        if not final:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            final.append(Path(proc.stdout.readline().strip()))

    try:
        first = Path(proc.stdout.readline().strip())
        assert first.parent == tmp_path and not (first / LOCK_NAME).exists()
        long_ago = time.time() - tempdir_mod._STALE_UNLOCKED_DIR_SECONDS - 5
        os.utime(first, (long_ago, long_ago))
        if resume == "during_sweep":
            real_tree_size = tempdir_mod._tree_size

            def tree_size(dir_fd: int) -> int:
                assert os.path.exists(first / LOCK_NAME)  # claimed, nothing deleted yet
                resume_creator()
                return real_tree_size(dir_fd)

            monkeypatch.setattr(tempdir_mod, "_tree_size", tree_size)
        (found,) = sweep_stale_temp_dirs(PREFIX, tmp_path, remove=True)
        assert found.path == first and found.removed and not first.exists()
        monkeypatch.undo()
        resume_creator()
        (path,) = final
        assert path != first and path.parent == tmp_path and (path / LOCK_NAME).is_file()
        assert sweep_stale_temp_dirs(PREFIX, tmp_path, remove=True) == []  # live: kept
        assert path.is_dir() and proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdin.close()
        proc.stdout.close()


def test_a_missing_parent_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        sweep_stale_temp_dirs(PREFIX, tmp_path / "missing")
