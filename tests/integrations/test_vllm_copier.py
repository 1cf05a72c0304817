"""The worker's copy planning: vLLM transfer specs -> copy plans over the row layout, byte for byte.

No vLLM needed: numpy arrays and torch CPU tensors (the module is skipped without torch).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from kvtier.errors import KvtierError
from kvtier.integrations.vllm.copier import ChunkCopyPlanner, plan_group_layout
from kvtier.integrations.vllm.swap import VllmSwapBackend, vllm_swap_backend
from kvtier.transfer import HostCopyBackend, aligned_host_array


def _run(plan: Any) -> None:
    HostCopyBackend().run(plan)


def test_group_plan_packs_references_and_rejects_overflow() -> None:
    plans = plan_group_layout([[(0, 100), (1, 50)], [(2, 30)]], blocks_per_chunk=2, rank_bytes=300)
    assert [(r.tensor_idx, r.row_offset) for r in plans[0]] == [(0, 0), (1, 200)]
    assert [(r.tensor_idx, r.row_offset) for r in plans[1]] == [(2, 0)]
    with pytest.raises(KvtierError, match="needs 302 bytes"):
        plan_group_layout([[(0, 100), (1, 51)]], blocks_per_chunk=2, rank_bytes=300)


def _devices(num_blocks: int = 8) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 255, size=(num_blocks, 16), dtype=np.uint8) for _ in range(2)]


def test_store_then_load_round_trips_a_partial_first_chunk() -> None:
    """Blocks 3..6 of a request with 2 blocks per chunk: the first chunk is entered half way."""
    bpc = 2
    plans = plan_group_layout([[(0, 16), (1, 12)]], bpc, rank_bytes=64)
    devices = _devices()
    rows = np.zeros((4, 64), dtype=np.uint8)
    block_ids = np.array([5, 1, 7, 2])
    slots = np.array([3, 0, 2])  # chunks 1, 2, 3 of the request (blocks 2-3, 4-5, 6-7)
    _run(ChunkCopyPlanner(plans, devices, rows, bpc).plan(block_ids, [4], [3], slots, to_device=False))
    # Block 3 is the second sub-block of chunk 1 (row 3): tensor 0 at 16, tensor 1 at 32 + 12.
    assert (rows[3, 16:32] == devices[0][5]).all()
    assert (rows[3, 44:56] == devices[1][5, :12]).all()
    assert (rows[0, 0:16] == devices[0][1]).all() and (rows[0, 16:32] == devices[0][7]).all()
    assert (rows[2, 0:16] == devices[0][2]).all()
    assert not rows[1].any() and not rows[3, :16].any(), "nothing outside the planned pieces is written"

    restored = [np.zeros_like(d) for d in devices]
    _run(ChunkCopyPlanner(plans, restored, rows, bpc).plan(block_ids, [4], [3], slots, to_device=True))
    for b in block_ids:
        assert (restored[0][b] == devices[0][b]).all()
        assert (restored[1][b, :12] == devices[1][b, :12]).all()
        assert not restored[1][b, 12:].any(), "padding past the unpadded page is not copied"


def test_groups_take_their_own_rows_in_order() -> None:
    plans = plan_group_layout([[(0, 16)], [(1, 16)]], 1, rank_bytes=16)
    devices = _devices()
    rows = np.zeros((4, 16), dtype=np.uint8)
    planner = ChunkCopyPlanner(plans, devices, rows, 1)
    _run(planner.plan(np.array([1, 2, 3]), [2, 1], [0, 4], np.array([0, 1, 2]), False))
    assert (rows[0] == devices[0][1]).all() and (rows[1] == devices[0][2]).all()
    assert (rows[2] == devices[1][3]).all()


def test_inconsistent_specs_are_rejected() -> None:
    plans = plan_group_layout([[(0, 16)]], 2, rank_bytes=32)
    planner = ChunkCopyPlanner(plans, _devices(), np.zeros((4, 32), dtype=np.uint8), 2)
    with pytest.raises(KvtierError, match="rows"):
        planner.plan(np.array([1, 2, 3]), [3], [0], np.array([0]), False)
    with pytest.raises(KvtierError, match="mismatch"):
        planner.plan(np.array([1, 2]), [2], [0], np.array([0, 1]), False)
    with pytest.raises(KvtierError, match="destination block id 9 is out of range"):
        planner.plan(np.array([1, 2]), [2], [0], np.array([4]), False)  # row 4 of 4
    with pytest.raises(KvtierError, match="source block id 8 is out of range"):
        planner.plan(np.array([8]), [1], [0], np.array([0]), False)  # device block 8 of 8
    with pytest.raises(KvtierError, match="2 groups"):
        planner.plan(np.array([1, 2]), [1, 1], [0, 0], np.array([0, 1]), False)


# --- torch CPU tensors in the layouts vLLM uses ------------------------------------------------

torch = pytest.importorskip("torch", reason="torch is not installed")

LAYERS, BLOCKS, PAGE = 3, 12, 96  # PAGE: one of K or V for one layer and one block


def _per_layer_kv() -> tuple[list[Any], list[Any]]:
    """Separate K and V tensors per layer (vLLM's per-layer caches with K/V split)."""
    tensors = [torch.randint(-128, 128, (BLOCKS, PAGE), dtype=torch.int8) for _ in range(2 * LAYERS)]
    return tensors, tensors


def _per_layer_block_major() -> tuple[list[Any], list[Any]]:
    """One tensor per layer holding K and V of a block together ([blocks, 2, page])."""
    tensors = [torch.randint(-128, 128, (BLOCKS, 2, PAGE), dtype=torch.int8) for _ in range(LAYERS)]
    return tensors, [t.view(BLOCKS, 2 * PAGE) for t in tensors]


def _one_tensor_block_major() -> tuple[list[Any], list[Any]]:
    """All layers in one allocation, block-major ([blocks, layers, 2, page]); per-layer views of it."""
    pool = torch.randint(-128, 128, (BLOCKS, LAYERS, 2, PAGE), dtype=torch.int8)
    return [pool], [pool[:, layer].reshape(BLOCKS, 2 * PAGE) for layer in range(LAYERS)]


def _one_tensor_layer_major() -> tuple[list[Any], list[Any]]:
    """All layers in one allocation, layer-major ([layers, 2, blocks, page]); per-layer K and V views."""
    pool = torch.randint(-128, 128, (LAYERS, 2, BLOCKS, PAGE), dtype=torch.int8)
    return [pool], [pool[layer, kv] for layer in range(LAYERS) for kv in range(2)]


LAYOUTS = {
    "per-layer K/V tensors": _per_layer_kv,
    "per-layer tensors, block-major": _per_layer_block_major,
    "one tensor, block-major": _one_tensor_block_major,
    "one tensor, layer-major": _one_tensor_layer_major,
}


def _snapshot(views: list[Any], block: int) -> list[bytes]:
    return [v[block].numpy().tobytes() for v in views]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("bpc", [1, 2])
def test_torch_cpu_layouts_round_trip_byte_exact(layout: str, bpc: int) -> None:
    owners, views = LAYOUTS[layout]()
    refs = [(i, int(v.shape[1])) for i, v in enumerate(views)]
    rank_bytes = bpc * sum(size for _, size in refs)
    plans = plan_group_layout([refs], bpc, rank_bytes)
    region_rows = aligned_host_array((10, 2 * rank_bytes + 64))  # rank 1's part of the rows
    rank_rows = region_rows[:, rank_bytes : 2 * rank_bytes]
    planner = ChunkCopyPlanner(plans, views, rank_rows, bpc)
    blocks = np.array([7, 2, 3, 4, 11])  # a run of consecutive blocks and strays
    slots = np.arange(-(-len(blocks) // bpc))[::-1] + 2  # chunk rows, in reverse order
    want = {int(b): _snapshot(views, int(b)) for b in blocks}
    store = planner.plan(blocks, [5], [0], slots, to_device=False)
    assert store.nbytes == 5 * sum(size for _, size in refs)
    _run(store)
    assert not region_rows[:, :rank_bytes].any() and not region_rows[:, 2 * rank_bytes :].any()
    for owner in owners:
        owner.zero_()
    _run(planner.plan(blocks, [5], [0], slots, to_device=True))
    for b in blocks:
        assert _snapshot(views, int(b)) == want[int(b)], f"block {b} changed on the round trip"
    untouched = sorted(set(range(BLOCKS)) - {int(b) for b in blocks})
    assert all(not views[0][b].any() for b in untouched), "a load wrote a block it was not asked for"


def test_layer_major_pieces_of_a_block_copy_as_one_strided_run() -> None:
    _, views = _one_tensor_layer_major()
    refs = [(i, PAGE) for i in range(len(views))]
    planner = ChunkCopyPlanner(plan_group_layout([refs], 1, len(refs) * PAGE), views, aligned_host_array((4, 4096)), 1)
    plan = planner.plan(np.array([5, 1]), [2], [0], np.array([2, 0]), False)
    (batch,) = plan.batches
    runs = batch.runs()
    assert runs.counts.tolist() == [2 * LAYERS, 2 * LAYERS], "each block's K/V pages form one run"
    assert runs.src_steps.tolist() == [BLOCKS * PAGE] * 2 and runs.dst_steps.tolist() == [PAGE] * 2


def test_block_major_block_copies_as_one_piece() -> None:
    _, views = _one_tensor_block_major()
    refs = [(i, 2 * PAGE) for i in range(LAYERS)]
    planner = ChunkCopyPlanner(
        plan_group_layout([refs], 1, LAYERS * 2 * PAGE), views, aligned_host_array((4, LAYERS * 2 * PAGE)), 1
    )
    plan = planner.plan(np.array([5, 9]), [2], [0], np.array([3, 0]), False)
    assert plan.num_copies == 2 * LAYERS
    (batch,) = plan.batches
    assert batch.merged().num_copies == 2, "every layer of a block is adjacent on both sides: one copy per block"


# --- vLLM's batched swap op ------------------------------------------------------------------


def _memmove_op(calls: list[int]) -> Any:
    """The contract of vLLM's swap_blocks_batch, executed on host memory: copy sizes[i] bytes src[i] -> dst[i]."""

    def op(src: Any, dst: Any, sizes: Any, is_src_access_order_any: bool) -> None:
        assert src.dtype == dst.dtype == sizes.dtype == torch.int64
        calls.append(len(sizes))
        for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
            ctypes.memmove(d, s, n)

    return op


def test_swap_backend_hands_the_op_one_descriptor_per_merged_copy() -> None:
    owners, views = _per_layer_kv()
    refs = [(i, PAGE) for i in range(len(views))]
    rows = aligned_host_array((6, 2 * len(refs) * PAGE))
    planner = ChunkCopyPlanner(plan_group_layout([refs], 2, len(refs) * 2 * PAGE), views, rows, 2)
    blocks = np.array([3, 4, 9])
    want = {int(b): _snapshot(views, int(b)) for b in blocks}
    calls: list[int] = []
    backend = VllmSwapBackend(_memmove_op(calls))
    store = planner.plan(blocks, [3], [1], np.array([4, 1]), to_device=False)
    kept = backend.run(store)
    assert kept is not None and calls == [store.num_copies]
    for owner in owners:
        owner.zero_()
    backend.run(planner.plan(blocks, [3], [1], np.array([4, 1]), to_device=True))
    assert len(calls) == 2
    for b in blocks:
        assert _snapshot(views, int(b)) == want[int(b)]


def test_vllm_cpu_build_has_no_swap_op() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the op may exist there")
    assert vllm_swap_backend() is None
