"""TieringManager.create: the CPU tier sized from bytes per block, with or without a KV geometry."""

from __future__ import annotations

from pathlib import Path

import pytest

from held_pages import pages_held_under
from kvtier import ConfigError, KVGeometry, Namespace, TieringManager
from kvtier.errors import RegionError
from kvtier.units import PAGE_SIZE


def test_create_takes_bytes_per_block_for_a_namespace_without_geometry(tmp_path: Path, private_shm: Path) -> None:
    ns = Namespace("engine-model", extra=(("engine", "test"), ("row_bytes", "5000")))
    mgr = TieringManager.create(
        namespace=ns, block_bytes=5000, cpu_bytes=10 * PAGE_SIZE * 2, shm_dir=private_shm,
        tiers=[{"type": "fs", "root": str(tmp_path / "fs"), "scan_in_background": False}],
    )  # fmt: skip
    try:
        assert mgr.block_bytes == 5000
        assert mgr.rows.strides[0] == -(-5000 // PAGE_SIZE) * PAGE_SIZE
        assert mgr.primary.num_blocks == (20 * PAGE_SIZE) // mgr.rows.strides[0]
        assert mgr.tiers[0].context.block_bytes == 5000
    finally:
        mgr.shutdown()


def test_block_bytes_overrides_the_geometry_and_bad_values_are_refused(private_shm: Path) -> None:
    ns = Namespace("m", KVGeometry.from_block_bytes(8192))
    mgr = TieringManager.create(namespace=ns, block_bytes=4096, num_cpu_blocks=2, shm_dir=private_shm)
    try:
        assert mgr.block_bytes == 4096
    finally:
        mgr.shutdown()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="block_bytes must be a positive integer"):
            TieringManager.create(namespace=ns, block_bytes=bad, num_cpu_blocks=2, shm_dir=private_shm)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="give block_bytes"):
        TieringManager.create(namespace=Namespace("m", extra=(("a", "b"),)), num_cpu_blocks=2, shm_dir=private_shm)
    with pytest.raises(ConfigError, match="holds no block of 8192 bytes"):
        TieringManager.create(namespace=ns, cpu_bytes=4096, shm_dir=private_shm)


def test_a_namespace_needs_a_geometry_or_an_engine_layout() -> None:
    with pytest.raises(ConfigError, match="needs a KV geometry"):
        Namespace("m")
    a = Namespace("m", extra=(("row_bytes", "1"),))
    b = Namespace("m", extra=(("row_bytes", "2"),))
    assert a.digest != b.digest and a.canonical() == Namespace("m", extra=(("row_bytes", "1"),)).canonical()


@pytest.mark.parametrize("mappers", [1, 2])
def test_a_manager_dropped_without_shutdown_gives_its_memory_back(
    private_shm: Path, mappers: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (review, 2026-12-02): a manager collected without shutdown() kept its region's
    descriptor open, and with it every tmpfs page (the path, already unlinked, showed nothing) until
    the process exited; with expected_mappers=2 the named file stayed too."""
    import gc

    ns = Namespace("dropped", KVGeometry.from_block_bytes(8192))
    for _ in range(2):
        mgr = TieringManager.create(namespace=ns, num_cpu_blocks=2048, shm_dir=str(private_shm), prefault=True,
                                    expected_mappers=mappers)  # fmt: skip
        del mgr
        gc.collect()
    assert pages_held_under(private_shm) == [], "the dropped regions' pages are still held"
    assert "dropped without close()" in caplog.text


@pytest.mark.parametrize(
    ("bad", "names"),
    [
        ({"namespace": "m"}, "namespace"),
        ({"policy": 5}, "policy"),
        ({"policy": None}, "policy"),
        ({"expected_mappers": "2"}, "expected_mappers"),
        ({"expected_mappers": 2.5}, "expected_mappers"),
        ({"expected_mappers": True}, "expected_mappers"),
        ({"backpressure": "on"}, "backpressure"),
        ({"region_name": "x" * 300}, "region_name"),
        ({"region_name": ""}, "region_name"),
        ({"events": "no"}, "events"),
        ({"prefault": 1}, "prefault"),
        ({"tiers": "fs"}, "tiers"),
        ({"shutdown_timeout": 0}, "shutdown_timeout must be above 0"),
        ({"shutdown_timeout": 0.0}, "shutdown_timeout must be above 0"),
        # Regression (review, 2026-12-05): these said "give a number of seconds at least 0", and 0 is refused
        ({"shutdown_timeout": float("inf")}, "inf is not a usable duration: give a number of seconds above 0"),
        ({"shutdown_timeout": float("nan")}, "give a number of seconds above 0"),
        ({"shutdown_timeout": -1}, "shutdown_timeout=-1 is not a usable duration: give a number of seconds above 0"),
    ],
)
def test_a_wrong_argument_to_create_is_named(private_shm: Path, bad: dict[str, object], names: str) -> None:
    """Regression (review, 2026-12-02): wrong types reached create()'s depths (AttributeError,
    TypeError, struct.error, OSError 36) or were taken for something else (events="no" is truthy,
    region_name="" meant the default)."""
    args: dict[str, object] = {"namespace": Namespace("args", KVGeometry.from_block_bytes(8192)),
                               "num_cpu_blocks": 4, "shm_dir": str(private_shm), **bad}  # fmt: skip
    with pytest.raises(ConfigError, match=names):
        TieringManager.create(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("sweep_stale", [True, False])
def test_an_shm_dir_that_is_a_file_is_named(private_shm: Path, tmp_path: Path, sweep_stale: bool) -> None:
    """Regression (review, 2026-12-05): a regular file as shm_dir gave a bare NotADirectoryError
    (from the sweep, or with a path under the file), not a kvtier error naming it."""
    not_a_dir = tmp_path / "regular-file"
    not_a_dir.write_bytes(b"x")
    for shm_dir, what in ((not_a_dir, "is not a directory"), (tmp_path / "missing", "does not exist")):
        with pytest.raises(RegionError, match=f"shared-memory directory {shm_dir} {what}: give shm_dir a directory"):
            TieringManager.create(namespace=Namespace("shm-dir", KVGeometry.from_block_bytes(8192)), num_cpu_blocks=4,
                                  shm_dir=str(shm_dir), sweep_stale=sweep_stale)  # fmt: skip
    assert not_a_dir.read_bytes() == b"x" and not (tmp_path / "missing").exists()


def test_num_cpu_blocks_above_the_documented_bound_is_a_config_error(private_shm: Path) -> None:
    """Regression (docs audit, 2026-12-05): the reference bounds num_cpu_blocks at 2^32 in every
    source, the Python API included (a ConfigError naming the setting); ``create`` took more and
    failed later, at the region, with InsufficientSpaceError asking to lower cpu_bytes."""
    ns = Namespace("m", KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=16))
    with pytest.raises(ConfigError, match=r"num_cpu_blocks=4294967297 is above"):
        TieringManager.create(namespace=ns, num_cpu_blocks=2**32 + 1, shm_dir=private_shm)
    assert not list(private_shm.iterdir())
