"""Device <-> CPU copies on a CUDA device, with the region page-locked: every backend, byte for byte.

Skipped without CUDA (the development VMs have none); ``benchmarks/gpu_check.sh``
runs this module on a GPU machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device here; benchmarks/gpu_check.sh runs these on a GPU machine", allow_module_level=True)

from kvtier.region import SharedRegion  # noqa: E402
from kvtier.transfer import (  # noqa: E402
    BlockMapping,
    BlockPieces,
    CopyBackend,
    TorchCopyBackend,
    TransferEngine,
    copy_blocks,
)

LAYERS, BLOCKS, PAGE = 4, 64, 16 * 1024


def _backends() -> dict[str, CopyBackend]:
    out: dict[str, CopyBackend] = {"torch": TorchCopyBackend()}
    try:
        from kvtier.integrations.vllm.swap import vllm_swap_backend
    except ImportError:
        return out
    swap = vllm_swap_backend()
    if swap is not None:
        out["vllm"] = swap
    return out


@pytest.fixture
def pinned_region(private_shm: Path) -> Iterator[SharedRegion]:
    region = SharedRegion("cuda-test", 32, 2 * LAYERS * PAGE, shm_dir=private_shm, pin=True)
    assert region.pinned, "cudaHostRegister failed on the region"
    yield region
    region.close()


def _layouts() -> dict[str, tuple[list[Any], list[Any]]]:
    per_layer = [torch.randint(-128, 128, (BLOCKS, PAGE), dtype=torch.int8, device="cuda") for _ in range(2 * LAYERS)]
    layer_major = torch.randint(-128, 128, (LAYERS, 2, BLOCKS, PAGE), dtype=torch.int8, device="cuda")
    block_major = torch.randint(-128, 128, (BLOCKS, LAYERS, 2, PAGE), dtype=torch.int8, device="cuda")
    return {
        "per-layer K/V": (per_layer, per_layer),
        "layer-major": ([layer_major], [layer_major[i, kv] for i in range(LAYERS) for kv in range(2)]),
        "block-major": ([block_major], [block_major[:, i, kv] for i in range(LAYERS) for kv in range(2)]),
    }


@pytest.mark.parametrize("backend_name", list(_backends()))
@pytest.mark.parametrize("layout", ["per-layer K/V", "layer-major", "block-major"])
def test_store_and_load_through_a_pinned_region(pinned_region: SharedRegion, backend_name: str, layout: str) -> None:
    owners, views = _layouts()[layout]
    rows = pinned_region.rows
    host = BlockPieces.from_rows(rows, [i * PAGE for i in range(2 * LAYERS)], [PAGE] * (2 * LAYERS))
    device = BlockPieces.from_block_views(views)
    blocks = np.array([5, 6, 7, 8, 40, 3])
    slots = np.array([10, 11, 12, 13, 0, 31])
    want = [torch.stack([v[int(b)] for v in views]).cpu() for b in blocks]
    engine = TransferEngine(device_backend=_backends()[backend_name])
    try:
        engine.submit(1, BlockMapping(device, host).plan(blocks, slots))
        engine.wait([1], timeout=30)
        (stored,) = engine.poll()
        assert stored.success and stored.bytes_moved == len(blocks) * 2 * LAYERS * PAGE
        for j, s in enumerate(slots):
            assert bytes(rows[s, : 2 * LAYERS * PAGE]) == want[j].numpy().tobytes()
        for owner in owners:
            owner.zero_()
        engine.submit(2, BlockMapping(host, device).plan(slots, blocks))
        engine.wait([2], timeout=30)
        (loaded,) = engine.poll()
        assert loaded.success and loaded.seconds > 0
        for j, b in enumerate(blocks):
            assert torch.equal(torch.stack([v[int(b)] for v in views]).cpu(), want[j])
        assert not views[0][0].any(), "a block that was not loaded stays zero"
    finally:
        engine.shutdown()
        del rows


def test_copy_blocks_pairs_between_cuda_and_pinned_rows(pinned_region: SharedRegion) -> None:
    rows = pinned_region.rows
    dev = torch.randint(-128, 128, (4, PAGE), dtype=torch.int8, device="cuda")
    host = torch.from_numpy(rows[:4, :PAGE]).view(torch.int8)
    assert copy_blocks([(host[i], dev[3 - i]) for i in range(4)]) == 4 * PAGE
    assert torch.equal(host.cuda(), dev.flip(0))
    del rows, host
