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


# --- 1. a restarted start never shares memory with a dead one ------------------------------------

MAPPER = textwrap.dedent(
    """
    import sys
    from kvtier.region import SharedRegion
    name, shm_dir, expected, index = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    region = SharedRegion(name, 4, 4096, expected_mappers=expected, shm_dir=shm_dir, attach_timeout=30)
    rows = region.rows
    rows[index, :8] = index + 1
    print("ready", region.is_creator, flush=True)
    for line in sys.stdin:
        if line.strip() == "read":
            print("seen", *[int(rows[i, 0]) for i in range(expected)], flush=True)
        elif line.strip() == "close":
            del rows
            region.close()
            print("closed", flush=True)
            break
    """
)


def _mapper(name: str, shm_dir: Path, expected: int, index: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", MAPPER, name, str(shm_dir), str(expected), str(index)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _ask(proc: subprocess.Popen[str], command: str | None = None) -> list[str]:
    assert proc.stdin is not None and proc.stdout is not None
    if command is not None:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
    line = proc.stdout.readline().split()
    assert line, f"mapper exited early (rc {proc.poll()})"
    return line


def test_restart_after_crash_in_the_unlink_window_maps_one_region(private_shm: Path) -> None:
    """Creator and one mapper of a 3-mapper start are SIGKILLed before the third attaches;
    3 new mappers with the same name must all map one (new) region, and leave nothing."""
    name, expected = "pinned-engine", 3
    crashed = [_mapper(name, private_shm, expected, i) for i in range(2)]
    try:
        for proc in crashed:
            assert _ask(proc)[0] == "ready"
    finally:
        for proc in crashed:
            proc.kill()
            proc.wait(timeout=10)
    assert [p.name for p in private_shm.iterdir()] == [f"kvtier-{name}.shm"], "the crash leaves the file"

    mappers = [_mapper(name, private_shm, expected, i) for i in range(expected)]
    try:
        ready = [_ask(p) for p in mappers]
        assert all(line[0] == "ready" for line in ready)
        assert [line[1] for line in ready].count("True") == 1, "exactly one creator for the new start"
        for proc in mappers:
            seen = _ask(proc, "read")
            assert seen == ["seen", "1", "2", "3"], f"a mapper sees another mapping: {seen}"
        assert not list(private_shm.iterdir()), "every expected mapper attached: the path must be gone"
        for proc in mappers:
            assert _ask(proc, "close") == ["closed"]
            proc.wait(timeout=10)
    finally:
        for proc in mappers:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    assert not list(private_shm.iterdir())


def test_an_explicit_generation_never_joins_another_live_start(private_shm: Path) -> None:
    from kvtier.errors import RegionError
    from kvtier.region import SharedRegion

    ours, theirs = bytes(range(16)), bytes(range(1, 17))
    other = SharedRegion("gen", 2, 4096, expected_mappers=2, shm_dir=private_shm, generation=theirs)
    try:
        assert other.generation == theirs
        with pytest.raises(RegionError, match="another live start"):
            SharedRegion("gen", 2, 4096, expected_mappers=2, shm_dir=private_shm, generation=ours)
        same = SharedRegion("gen", 2, 4096, expected_mappers=2, shm_dir=private_shm, generation=theirs)
        assert not same.is_creator and same.unlinked
        same.close()
    finally:
        other.close()


def test_a_late_extra_mapper_is_refused_not_given_a_second_region(private_shm: Path) -> None:
    from kvtier.errors import RegionError
    from kvtier.region import SharedRegion, region_path

    first = SharedRegion("full", 2, 4096, expected_mappers=2, shm_dir=private_shm)
    second = SharedRegion("full", 2, 4096, expected_mappers=2, shm_dir=private_shm)
    try:
        assert not region_path("full", private_shm).exists()
        # a third process of the same start (expected_mappers too low) attaching too late would
        # find no file and create a second region; the attach-only case is refused clearly
        with pytest.raises(RegionError, match="did not appear"):
            SharedRegion("full", 2, 4096, expected_mappers=2, shm_dir=private_shm, create=False, attach_timeout=0.1)
    finally:
        second.close()
        first.close()


# --- 2. nothing planted in /dev/shm can block, redirect or trick kvtier ------------------------

IS_ROOT = os.geteuid() == 0


def _plant_hostile_entries(shm: Path, outside: Path) -> dict[str, Path]:
    """One entry of each hostile kind, named like a region; returns name -> path."""
    import socket
    import stat as stat_mod

    from kvtier.region import SharedRegion

    planted: dict[str, Path] = {}
    fifo = shm / "kvtier-fifo.shm"
    os.mkfifo(fifo, 0o600)
    planted["fifo"] = fifo
    victim = outside / "victim.txt"
    victim.write_text("precious")
    link = shm / "kvtier-link.shm"
    link.symlink_to(victim)
    planted["symlink"] = link
    (shm / "kvtier-dir.shm").mkdir()
    planted["directory"] = shm / "kvtier-dir.shm"
    garbage = shm / "kvtier-garbage.shm"
    garbage.write_bytes(b"x" * 37)
    planted["headerless"] = garbage
    sock_path = shm / "kvtier-sock.shm"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(sock_path))
    sock.close()
    planted["socket"] = sock_path
    if IS_ROOT:
        dev = shm / "kvtier-dev.shm"
        os.mknod(dev, stat_mod.S_IFCHR | 0o600, os.makedev(1, 3))  # like /dev/null
        planted["device"] = dev
        # a valid, unheld region file, but another user's: never ours to remove
        foreign_path = shm / "kvtier-foreign.shm"
        with SharedRegion("model", 2, 4096, shm_dir=outside, expected_mappers=2) as model:
            image = model.path.read_bytes()
        foreign_path.write_bytes(image)
        os.chown(foreign_path, 65534, 65534)
        planted["foreign"] = foreign_path
    return planted


def _remove_planted(planted: dict[str, Path]) -> None:
    for path in planted.values():
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink(missing_ok=True)


def test_sweep_ignores_every_hostile_entry_and_never_blocks(private_shm: Path, tmp_path: Path) -> None:
    planted = _plant_hostile_entries(private_shm, tmp_path)
    # one genuinely stale region of this user (its process was SIGKILLed inside the unlink window)
    child = textwrap.dedent(
        f"""
        import os, signal
        from kvtier.region import SharedRegion
        region = SharedRegion("dead", 2, 4096, expected_mappers=2, shm_dir={str(private_shm)!r})  # held until killed
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    subprocess.run([sys.executable, "-c", child], timeout=60, check=False)
    assert (private_shm / "kvtier-dead.shm").exists()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "sweep-shm", "--remove", "--shm-dir", str(private_shm)],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "removed" in out.stdout and "kvtier-dead.shm" in out.stdout
        assert not (private_shm / "kvtier-dead.shm").exists()
        reasons = {
            "fifo": "FIFO", "symlink": "symbolic link", "directory": "directory", "headerless": "not a kvtier region",
            "socket": "socket", "device": "character device", "foreign": "owned by uid 65534",
        }  # fmt: skip
        for kind, path in planted.items():
            assert os.path.lexists(path), f"the sweep removed the {kind} entry"
            line = next((x for x in out.stdout.splitlines() if path.name in x), "")
            assert line.startswith("ignored") and reasons[kind] in line, (kind, out.stdout)
        assert (tmp_path / "victim.txt").read_text() == "precious"
    finally:
        _remove_planted(planted)


def test_create_next_to_hostile_entries_does_not_hang(private_shm: Path, tmp_path: Path, namespace: object) -> None:
    """TieringManager.create sweeps the directory first: a FIFO there used to block it forever."""
    planted = _plant_hostile_entries(private_shm, tmp_path)
    child = textwrap.dedent(
        f"""
        from kvtier import KVGeometry, Namespace, TieringManager
        ns = Namespace("m", KVGeometry.from_block_bytes(8192))
        mgr = TieringManager.create(namespace=ns, num_cpu_blocks=4, shm_dir={str(private_shm)!r})
        mgr.shutdown()
        print("ok", flush=True)
        """
    )
    try:
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
        assert all(os.path.lexists(p) for p in planted.values())
    finally:
        _remove_planted(planted)


def test_a_hostile_entry_at_the_region_path_is_refused_never_used(private_shm: Path, tmp_path: Path) -> None:
    from kvtier.errors import RegionError
    from kvtier.region import SharedRegion

    planted = _plant_hostile_entries(private_shm, tmp_path)
    try:
        for kind, path in planted.items():
            name = path.name.removeprefix("kvtier-").removesuffix(".shm")
            with pytest.raises(RegionError, match="not a kvtier region") as info:
                SharedRegion(name, 2, 4096, shm_dir=private_shm, attach_timeout=1)
            assert str(path) in str(info.value), kind
            assert os.path.lexists(path)
        assert (tmp_path / "victim.txt").read_text() == "precious"
    finally:
        _remove_planted(planted)
