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
    # A directory without a lock file: not proven ours.
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


def test_a_missing_parent_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        sweep_stale_temp_dirs(PREFIX, tmp_path / "missing")
