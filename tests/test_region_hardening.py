"""SharedRegion against hostile /dev/shm entries, crashed starts and memory limits (issue 9).

Every test uses real files in a private directory of /dev/shm and real processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

MEMCG_ROOT = Path("/sys/fs/cgroup/memory")


def _own_memcg() -> Path | None:
    """This process's cgroup-v1 memory controller directory, if there is one."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            path = MEMCG_ROOT / rel.lstrip("/")
            return path if (path / "memory.limit_in_bytes").exists() else None
    return None


@pytest.fixture
def small_memcg() -> Iterator[Path]:
    """A child memory cgroup of 48 MiB whose OOM killer is disabled, so a charge beyond the
    limit fails with ENOMEM instead of killing the process (cgroup v1 only, needs root)."""
    parent = _own_memcg()
    if parent is None or not os.access(parent, os.W_OK):
        pytest.skip("needs a writable cgroup-v1 memory controller (run as root)")
    cg = parent / f"kvtier-test-{uuid.uuid4().hex[:8]}"
    try:
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(48 << 20))
        (cg / "memory.oom_control").write_text("1")
    except OSError as exc:
        if cg.exists():
            cg.rmdir()
        pytest.skip(f"cannot configure a memory cgroup here: {exc}")
    try:
        yield cg
    finally:
        for pid in (cg / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        for _ in range(100):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def test_prefault_beyond_a_memory_limit_is_a_clear_error_and_leaves_no_file(
    private_shm: Path, small_memcg: Path
) -> None:
    """MADV_POPULATE_WRITE failing with ENOMEM (memory cgroup limit) must not fall back to touching
    pages (a SIGBUS, an OOM kill or, here, a hang later): InsufficientSpaceError naming the
    directory and the shortfall, and no file left."""
    child = textwrap.dedent(
        f"""
        import os, sys
        with open({str(small_memcg / "cgroup.procs")!r}, "w") as f:
            f.write(str(os.getpid()))
        from kvtier.errors import InsufficientSpaceError
        from kvtier.region import SharedRegion
        try:
            SharedRegion("memcg", 64, 1 << 20, shm_dir={str(private_shm)!r}, prefault=True)
        except InsufficientSpaceError as exc:
            print("refused:", exc, flush=True)
            sys.exit(0)
        print("created", flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("creating a region beyond the memory limit hung instead of failing")
    assert proc.returncode == 0, err
    assert out.startswith("refused:"), out
    assert str(private_shm) in out and "short" in out, out
    assert not list(private_shm.iterdir())
