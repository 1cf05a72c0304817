"""TransferEngine: asynchronous FIFO block copies between a device pool and CPU rows."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import KvtierError
from kvtier.region import SharedRegion
from kvtier.transfer import TransferEngine, copy_blocks

pytestmark = pytest.mark.usefixtures("shm_leak_check")


def test_store_and_load_between_pool_and_shared_rows() -> None:
    region = SharedRegion("transfer-test", 8, 65536)
    rows = region.rows
    pool = np.random.default_rng(0).integers(0, 256, (4, 65536), dtype=np.uint8)
    engine = TransferEngine()
    try:
        engine.submit(1, [(rows[5 + i, :65536], pool[i]) for i in range(3)])
        engine.wait([1], timeout=10)
        (result,) = engine.poll()
        assert result.job_id == 1 and result.success and result.bytes_moved == 3 * 65536
        back = np.zeros_like(pool)
        engine.submit(2, [(back[i], rows[5 + i, :65536]) for i in range(3)])
        engine.submit(3, [])
        engine.wait(timeout=10)
        assert [r.job_id for r in engine.poll()] == [2, 3], "jobs finish in FIFO order"
        assert np.array_equal(back[:3], pool[:3])
        assert not engine.has_pending()
    finally:
        engine.shutdown()
        del rows
        region.close()


def test_failed_job_is_reported_not_raised() -> None:
    engine = TransferEngine()
    try:
        engine.submit(7, [(np.zeros(10, np.uint8), np.zeros(11, np.uint8))])
        engine.wait([7], timeout=10)
        (result,) = engine.poll()
        assert not result.success and "size mismatch" in (result.error or "")
    finally:
        engine.shutdown()
    with pytest.raises(KvtierError, match="shut down"):
        engine.submit(8, [])


def test_copy_blocks_sync() -> None:
    src = np.arange(16, dtype=np.uint8)
    dst = np.zeros(16, dtype=np.uint8)
    assert copy_blocks([(dst, src)]) == 16
    assert np.array_equal(dst, src)
