"""Admin commands never follow links: ``kvtier inspect --verify --remove-corrupt`` walks an fs
root through directory descriptors, no-follow, as the tier does, so nothing outside the root
is read, entered or deleted, whatever was planted in it.

Each case plants one hostile entry (a symlinked namespace, shard, value, manifest, ``tmp`` or
instance directory pointing at a victim outside the root that looks like kvtier data with a
corrupt value; a FIFO; a foreign-owned corrupt value), then inspects through the Python API
and the CLI: victims survive, a FIFO blocks nothing, and the planted entry is reported; a
corrupt value of ours in the real namespace is removed (the positive control).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fs_helpers import AlignedRows, fill, key_of, make_tier, store

from kvtier.tiers.fs import verify_root
from kvtier.tiers.fs_layout import value_path

BB = 16 * 1024
IS_ROOT = os.geteuid() == 0


@pytest.fixture
def rows() -> Iterator[np.ndarray]:
    aligned = AlignedRows(16, BB)
    yield aligned.rows


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def _namespace_with_values(root: Path, rows: np.ndarray, model: str, n: int, salt: bytes) -> tuple[Path, list[bytes]]:
    """A real namespace directory under ``root`` holding ``n`` values; returns it and the keys."""
    keys = [key_of(i, salt) for i in range(n)]
    tier = make_tier(root, rows, BB, model_id=model)
    try:
        fill(rows, range(n), keys, BB)
        assert store(tier, keys, list(range(n))).success
        return tier.ns_dir, keys
    finally:
        tier.shutdown()


class Scene:
    """A root with one real namespace (one corrupt value of ours) and, outside it, a victim
    namespace of the same shape whose corrupt value the old code deleted through a link."""

    def __init__(self, tmp: Path, rows: np.ndarray) -> None:
        self.root = tmp / "root"
        self.outside = tmp / "outside"
        self.ns_dir, self.keys = _namespace_with_values(self.root, rows, "test/real", 3, b"real")
        self.ours_corrupt = value_path(self.ns_dir, self.keys[0])
        _corrupt(self.ours_corrupt)
        self.victim_ns, victim_keys = _namespace_with_values(self.outside, rows, "test/victim", 3, b"victim")
        self.victims = [value_path(self.victim_ns, k) for k in victim_keys]
        for victim in self.victims:
            _corrupt(victim)  # what an inspect that wandered here would delete
        self.contents = {p: p.read_bytes() for p in self.outside.rglob("*") if p.is_file()}
        self.planted: Path | None = None

    def untouched_outside(self) -> None:
        now = {p: p.read_bytes() for p in self.outside.rglob("*") if p.is_file()}
        assert now == self.contents, f"files outside the root changed: {sorted(set(self.contents) ^ set(now))}"


def _plant_namespace_link(s: Scene) -> None:
    s.planted = s.root / s.victim_ns.name
    s.planted.symlink_to(s.victim_ns, target_is_directory=True)


def _plant_namespace_link_to_inside(s: Scene) -> None:
    """A link inside the root to a copy of the victim namespace kept outside (its name is its digest)."""
    s.planted = s.root / s.victim_ns.name
    os.symlink(os.path.relpath(s.victim_ns, s.root), s.planted)


def _plant_shard_link(s: Scene) -> None:
    shard = next(v.parent.name for v in s.victims if v.parent.name != s.ours_corrupt.parent.name)
    real = s.ns_dir / shard
    shutil.rmtree(real)
    real.symlink_to(s.victim_ns / shard, target_is_directory=True)
    s.planted = real


def _plant_value_link(s: Scene) -> None:
    s.planted = value_path(s.ns_dir, bytes.fromhex(s.victims[2].stem))
    s.planted.unlink(missing_ok=True)
    s.planted.symlink_to(s.victims[2])


def _plant_manifest_link(s: Scene) -> None:
    s.planted = s.ns_dir / "manifest.json"
    s.planted.unlink()
    s.planted.symlink_to(s.victim_ns / "manifest.json")


def _plant_tmp_link(s: Scene) -> None:
    dead = s.victim_ns / "tmp" / "12345-deadbeef0000"
    dead.mkdir()
    (dead / "leftover.1.tmp").write_bytes(b"x")
    s.contents[dead / "leftover.1.tmp"] = b"x"
    shutil.rmtree(s.ns_dir / "tmp")
    (s.ns_dir / "tmp").symlink_to(s.victim_ns / "tmp", target_is_directory=True)
    s.planted = s.ns_dir / "tmp"


def _plant_instance_link(s: Scene) -> None:
    target = s.outside / "instance"
    target.mkdir()
    (target / "leftover.1.tmp").write_bytes(b"y")
    s.contents[target / "leftover.1.tmp"] = b"y"
    s.planted = s.ns_dir / "tmp" / "999-cafecafecafe"
    s.planted.symlink_to(target, target_is_directory=True)


def _plant_fifo(s: Scene) -> None:
    s.planted = value_path(s.ns_dir, key_of(50, b"fifo"))
    os.mkfifo(s.planted)


def _plant_fifo_manifest(s: Scene) -> None:
    s.planted = s.ns_dir / "manifest.json"
    s.planted.unlink()
    os.mkfifo(s.planted)


def _plant_foreign_corrupt(s: Scene) -> None:
    s.planted = value_path(s.ns_dir, s.keys[1])
    _corrupt(s.planted)
    os.chown(s.planted, 65534, 65534)


PLANTS: dict[str, Callable[[Scene], None]] = {
    "namespace dir is a link out of the root": _plant_namespace_link,
    "namespace dir is a relative link": _plant_namespace_link_to_inside,
    "shard dir is a link": _plant_shard_link,
    "value is a link": _plant_value_link,
    "manifest is a link": _plant_manifest_link,
    "tmp is a link": _plant_tmp_link,
    "instance dir is a link": _plant_instance_link,
    "value is a FIFO": _plant_fifo,
    "manifest is a FIFO": _plant_fifo_manifest,
    "corrupt value of another user": _plant_foreign_corrupt,
}


def _inspect_api(s: Scene) -> dict[str, Any]:
    done = threading.Event()
    reports: list[object] = []

    def run() -> None:
        reports.append(verify_root(s.root, check_payloads=True, remove_corrupt=True))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    finished = done.wait(30)
    if not finished and s.planted is not None and s.planted.exists():  # free a reader stuck on the FIFO
        fd = os.open(s.planted, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    assert finished, "inspect blocked"
    return reports[0].to_dict()  # type: ignore[attr-defined,no-any-return]


def _check_reported(s: Scene, report: dict[str, Any]) -> None:
    """The planted entry appears where it belongs: an unsafe entry, a manifest error, a corrupt value."""
    assert s.planted is not None
    (ns,) = [n for n in report["namespaces"] if n["digest"] == s.ns_dir.name]
    unsafe = {e["path"] for e in report.get("unsafe_entries", []) + ns["unsafe_entries"]}
    corrupt = {e["path"] for e in ns["corrupt"]}
    if s.planted.name == "manifest.json":
        error = str(ns["manifest_error"])
        assert "a symbolic link" in error or "a FIFO" in error, error
    elif s.planted.exists() and s.planted.stat().st_uid == 65534:
        assert str(s.planted) in corrupt, corrupt
    else:
        assert str(s.planted) in unsafe, (s.planted, unsafe)
    assert [n["digest"] for n in report["namespaces"]] == [s.ns_dir.name], "a linked namespace was entered"


def _inspect_cli(s: Scene) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "inspect", str(s.root), "--verify", "--remove-corrupt", "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode in (0, 1), out.stderr
    assert "Traceback" not in out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize("via", ["api", "cli"])
@pytest.mark.parametrize("plant", list(PLANTS))
def test_inspect_remove_corrupt_never_leaves_the_root(plant: str, via: str, tmp_path: Path, rows: np.ndarray) -> None:
    if plant == "corrupt value of another user" and not IS_ROOT:
        pytest.skip("chown to another user needs root")
    s = Scene(tmp_path, rows)
    PLANTS[plant](s)
    report = (_inspect_api if via == "api" else _inspect_cli)(s)
    s.untouched_outside()
    if "manifest" not in plant:  # without a readable manifest of its own, a namespace is not verified
        assert not s.ours_corrupt.exists(), "the corrupt value of ours in the real namespace was not removed"
    assert s.planted is None or os.path.lexists(s.planted), "the planted entry was deleted"
    if plant == "corrupt value of another user":
        assert s.planted is not None and s.planted.stat().st_uid == 65534
    _check_reported(s, report)


def test_a_root_given_as_a_link_is_followed_as_named(tmp_path: Path, rows: np.ndarray) -> None:
    """The operator names the root; only what is below it is untrusted."""
    s = Scene(tmp_path, rows)
    alias = tmp_path / "alias"
    alias.symlink_to(s.root, target_is_directory=True)
    report = verify_root(alias, remove_corrupt=True)
    assert [ns.digest for ns in report.namespaces] == [s.ns_dir.name]
    assert report.namespaces[0].removed_corrupt == 1 and not s.ours_corrupt.exists()
    one = verify_root(alias / s.ns_dir.name)  # one namespace directory given directly
    assert [ns.digest for ns in one.namespaces] == [s.ns_dir.name] and one.namespaces[0].entries == 2


@pytest.mark.parametrize("given", ["dot", "link", "dot-slash", "digest-link"])
def test_one_namespace_directory_given_as_dot_or_through_a_link_verifies_under_its_own_name(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    """Regression (review, 2026-12-06): a namespace directory given as ``.`` (or reached through a
    link named otherwise) was checked against the name it was given by (empty, or the link's):
    "manifest names namespace ..., directory is ", nothing verified."""
    keys = [key_of(i, b"dot") for i in range(3)]
    fill(rows, range(3), keys, BB)
    tier = make_tier(tmp_path / "root", rows, BB)
    try:
        assert store(tier, keys, [0, 1, 2]).success
        ns_dir = tier.ns_dir
    finally:
        tier.shutdown()
    if given == "link":
        arg: Path = tmp_path / "my-namespace"
        arg.symlink_to(ns_dir, target_is_directory=True)
    elif given == "digest-link":  # a link named as the namespace, to the directory renamed
        backup = ns_dir.with_name("ns-backup")
        ns_dir.rename(backup)
        arg = tmp_path / ns_dir.name
        arg.symlink_to(backup, target_is_directory=True)
    else:
        monkeypatch.chdir(ns_dir)
        arg = Path(".") if given == "dot" else Path("./")
    (report,) = verify_root(arg).namespaces
    assert report.manifest_error is None and report.digest == ns_dir.name
    assert report.verified == 3 and not report.corrupt and report.ok


def test_the_tier_start_sweeps_no_linked_instance_directory(tmp_path: Path, rows: np.ndarray) -> None:
    """The tier's own sweep of dead writers' temp directories walks the same way."""
    s = Scene(tmp_path, rows)
    _plant_instance_link(s)
    tier = make_tier(s.root, rows, BB, model_id="test/real")
    tier.shutdown()
    s.untouched_outside()
    assert s.planted is not None and s.planted.is_symlink()
