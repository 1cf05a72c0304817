"""``kvtier inspect`` with a namespace manifest that is wrong, and a root with a stray manifest
(review, 2026-12-05): a manifest edited or planted with another ``block_bytes`` condemned every
value and ``--remove-corrupt`` deleted them all; a ``namespace`` field that is not an object
crashed the whole report; a stray ``manifest.json`` in the root hid every namespace under it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fs_helpers import AlignedRows, fill, key_of, make_tier, store

from kvtier.tiers.fs import verify_root
from kvtier.tiers.fs_layout import MANIFEST, value_path

BB = 16 * 1024


@pytest.fixture
def rows() -> Iterator[np.ndarray]:
    aligned = AlignedRows(8, BB)
    yield aligned.rows


def _namespace(root: Path, rows: np.ndarray, n: int = 4) -> tuple[Path, list[Path]]:
    keys = [key_of(i, b"manifest") for i in range(n)]
    tier = make_tier(root, rows, BB, model_id="test/manifest")
    try:
        fill(rows, range(n), keys, BB)
        assert store(tier, keys, list(range(n))).success
        return tier.ns_dir, [value_path(tier.ns_dir, k) for k in keys]
    finally:
        tier.shutdown()


def _edit_manifest(ns_dir: Path, **fields: object) -> None:
    path = ns_dir / MANIFEST
    manifest = json.loads(path.read_text())
    manifest.update(fields)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("block_bytes", [BB // 2, 2 * BB, 3 * BB + 100])
def test_a_manifest_with_another_block_size_condemns_no_value_that_verifies_by_itself(
    tmp_path: Path, rows: np.ndarray, block_bytes: int
) -> None:
    root = tmp_path / "root"
    ns_dir, values = _namespace(root, rows)
    contents = {p: p.read_bytes() for p in values}
    _edit_manifest(ns_dir, block_bytes=block_bytes)
    report = verify_root(root, check_payloads=True, remove_corrupt=True)
    (ns,) = report.namespaces
    assert ns.corrupt == [] and ns.removed_corrupt == 0
    assert len(ns.kept) == len(values)
    assert all("the manifest is suspect" in k.reason and f"says {block_bytes}" in k.reason for k in ns.kept)
    assert {p: p.read_bytes() for p in values} == contents, "a value was removed or changed"
    # Not ok (review, 2026-12-05): an engine with the real block size would refuse this manifest.
    assert ns.manifest_error is not None and "the manifest is suspect" in ns.manifest_error and not report.ok


def test_with_a_wrong_manifest_a_value_corrupt_by_its_own_checksum_is_still_corrupt(
    tmp_path: Path, rows: np.ndarray
) -> None:
    """The positive control: the own-header judgement keeps only what verifies."""
    root = tmp_path / "root"
    ns_dir, values = _namespace(root, rows)
    data = bytearray(values[0].read_bytes())
    data[-100] ^= 0xFF
    values[0].write_bytes(bytes(data))
    _edit_manifest(ns_dir, block_bytes=BB // 2)
    (ns,) = verify_root(root, check_payloads=True, remove_corrupt=True).namespaces
    assert [Path(c.path) for c in ns.corrupt] == [values[0]] and ns.removed_corrupt == 1
    assert not values[0].exists() and all(p.exists() for p in values[1:])
    assert len(ns.kept) == len(values) - 1


@pytest.mark.parametrize("namespace", ["x", ["a"], 5, None])
def test_a_manifest_whose_namespace_is_not_an_object_is_a_manifest_error_not_a_crash(
    tmp_path: Path, rows: np.ndarray, namespace: object
) -> None:
    root = tmp_path / "root"
    ns_dir, values = _namespace(root, rows)
    _edit_manifest(ns_dir, namespace=namespace)
    report = verify_root(root, check_payloads=True, remove_corrupt=True)
    (ns,) = report.namespaces
    assert ns.manifest_error == "manifest field 'namespace' is not an object"
    assert ns.to_dict()["model_id"] is None and not report.ok
    assert all(p.exists() for p in values)


@pytest.mark.parametrize("block_bytes", [True, "16384", -1, 0, 1.5])
def test_a_manifest_block_size_that_is_not_a_positive_integer_is_named(
    tmp_path: Path, rows: np.ndarray, block_bytes: object
) -> None:
    root = tmp_path / "root"
    ns_dir, values = _namespace(root, rows)
    _edit_manifest(ns_dir, block_bytes=block_bytes)
    (ns,) = verify_root(root, check_payloads=True, remove_corrupt=True).namespaces
    assert ns.manifest_error is not None and "block_bytes" in ns.manifest_error
    assert ns.corrupt == [] and all(p.exists() for p in values)


def test_a_huge_manifest_block_size_allocates_nothing_for_values_of_another_size(
    tmp_path: Path, rows: np.ndarray
) -> None:
    """A manifest naming 2^50 bytes a block made --verify allocate (and fail with "out of memory")."""
    root = tmp_path / "root"
    ns_dir, values = _namespace(root, rows)
    _edit_manifest(ns_dir, block_bytes=1 << 50)
    (ns,) = verify_root(root, check_payloads=True, remove_corrupt=True).namespaces
    assert ns.corrupt == [] and len(ns.kept) == len(values)


def test_a_stray_manifest_in_the_root_hides_no_namespace(tmp_path: Path, rows: np.ndarray) -> None:
    root = tmp_path / "root"
    ns_dir, values = _namespace(root, rows)
    (root / MANIFEST).write_text("{}")
    report = verify_root(root, check_payloads=True)
    assert [ns.digest for ns in report.namespaces] == [ns_dir.name]
    assert report.namespaces[0].verified == len(values) and report.ok
    # A namespace directory given as the root still is one, by its name or renamed.
    assert [ns.digest for ns in verify_root(ns_dir, check_payloads=True).namespaces] == [ns_dir.name]
    renamed = tmp_path / "renamed"
    ns_dir.rename(renamed)
    (only,) = verify_root(renamed, check_payloads=False).namespaces
    assert only.entries == len(values)
