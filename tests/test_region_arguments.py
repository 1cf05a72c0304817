"""SharedRegion's own arguments, given directly (review of 2026-12-06): a wrong type or a bound
beyond the header was a raw TypeError or struct.error (the latter after the file was mapped), and a
NaN or infinite attach_timeout waited for ever."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import RegionError
from kvtier.region import SharedRegion


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"num_rows": 1.5}, "num_rows must be an integer, got float"),
        ({"num_rows": "3"}, "num_rows must be an integer, got str"),
        ({"num_rows": True}, "num_rows must be an integer, got bool"),
        ({"row_bytes": 4096.0}, "row_bytes must be an integer, got float"),
        ({"expected_mappers": 2**40}, "expected_mappers must lie in 1..4294967295"),
        ({"expected_mappers": 0}, "expected_mappers must lie in 1..4294967295"),
    ],
)
def test_a_bad_argument_is_refused_before_anything_is_made(private_shm: Path, kwargs: dict[str, Any],
                                                           words: str) -> None:  # fmt: skip
    arguments: dict[str, Any] = {"num_rows": 2, "row_bytes": 4096, **kwargs}
    with pytest.raises(RegionError, match=words):
        SharedRegion("args", shm_dir=private_shm, **arguments)
    assert list(private_shm.iterdir()) == []


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0, True])
def test_an_attach_timeout_with_no_end_is_refused_at_once(private_shm: Path, timeout: float) -> None:
    start = time.monotonic()
    with pytest.raises(RegionError, match="attach_timeout must be a finite number of seconds"):
        SharedRegion("nobody", 2, 4096, shm_dir=private_shm, create=False, attach_timeout=timeout)
    assert time.monotonic() - start < 5


def test_numpy_integers_still_make_a_region(private_shm: Path) -> None:
    np = pytest.importorskip("numpy")
    region = SharedRegion("np", np.int64(2), np.int32(4096), shm_dir=private_shm)
    try:
        assert region.num_rows == 2 and type(region.num_rows) is int
    finally:
        region.close()
