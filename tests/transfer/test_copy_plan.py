"""Copy plans: allocations as byte spaces, checked batches, merging, strided runs, host execution."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import KvtierError
from kvtier.transfer import (
    BlockMapping,
    BlockPieces,
    CopyBatch,
    CopyPlan,
    HostCopyBackend,
    aligned_host_array,
    byte_space,
    copy_blocks,
)


def test_views_of_one_numpy_array_share_its_space() -> None:
    pool = np.zeros((8, 64), np.uint8)
    space, offset = byte_space(pool[3, 16:48])
    assert space.nbytes == 8 * 64 and offset == 3 * 64 + 16 and space.on_host
    again, _ = byte_space(pool[5])
    assert again.address == space.address


def test_aligned_host_array_starts_on_a_page() -> None:
    for shape in (1, (3, 5000), (2, 2, 4096)):
        arr = aligned_host_array(shape)
        assert arr.ctypes.data % 4096 == 0 and arr.dtype == np.uint8 and not arr.any()
    assert aligned_host_array(100, align=64).ctypes.data % 64 == 0


def test_batches_reject_entries_outside_their_allocation() -> None:
    src, _ = byte_space(np.zeros(100, np.uint8))
    dst, _ = byte_space(np.zeros(50, np.uint8))
    CopyBatch.create(src, dst, [0, 60], [0, 25], 25)
    with pytest.raises(KvtierError, match=r"destination range \[0, 51\) lies outside its allocation of 50"):
        CopyBatch.create(src, dst, [0], [0], 51)
    with pytest.raises(KvtierError, match="source range"):
        CopyBatch.create(src, dst, [-1], [0], 1)
    with pytest.raises(KvtierError, match="lengths differ"):
        CopyBatch.create(src, dst, [0, 1], [0], [1, 1])
    with pytest.raises(KvtierError, match="sizes must be >= 0"):
        CopyBatch.create(src, dst, [0], [0], [-1])
    with pytest.raises(KvtierError, match="must be integers"):
        CopyBatch.create(src, dst, [0.5], [0], 1)


def test_pairs_need_equal_sizes_and_contiguous_buffers() -> None:
    a = np.zeros((4, 16), np.uint8)
    with pytest.raises(KvtierError, match="size mismatch: dst has 16 bytes, src has 8"):
        CopyPlan.from_pairs([(a[0], a[1, :8])])
    with pytest.raises(KvtierError, match="not contiguous"):
        CopyPlan.from_pairs([(a[:, 0], a[0, :4])])
    with pytest.raises(KvtierError, match="numpy arrays or torch tensors"):
        CopyPlan.from_pairs([(bytearray(4), a[0, :4])])


def test_back_to_back_pairs_merge_into_one_copy() -> None:
    src = np.arange(64, dtype=np.uint8).reshape(4, 16)
    dst = np.zeros_like(src)
    plan = CopyPlan.from_pairs([(dst[i], src[i]) for i in range(4)])
    assert plan.num_copies == 4 and plan.nbytes == 64
    assert plan.batches[0].merged().num_copies == 1
    pointers = plan.pointer_arrays()
    assert pointers[0].tolist() == [src.ctypes.data] and pointers[2].tolist() == [64]
    assert copy_blocks(plan) == 64 and np.array_equal(dst, src)


def test_one_batch_spans_several_allocations_and_runs_stay_inside_one() -> None:
    a, b = np.arange(64, dtype=np.uint8), np.arange(64, 128, dtype=np.uint8)
    out = np.zeros(64, np.uint8)
    spaces = [byte_space(a)[0], byte_space(b)[0]]
    dst = byte_space(out)[0]
    # entries alternate between a and b with steps that would form a run within one space
    batch = CopyBatch.create(spaces, dst, [0, 8, 16, 24], [0, 8, 16, 24], 8, src_index=[0, 0, 1, 1])
    assert batch.runs().counts.tolist() == [1, 1, 1, 1] and batch.merged().num_copies == 2
    HostCopyBackend().run(CopyPlan.of([batch]))
    assert out[:16].tolist() == list(range(16)) and out[16:32].tolist() == list(range(80, 96))
    with pytest.raises(KvtierError, match="source space index out of range: 2 spaces"):
        CopyBatch.create(spaces, dst, [0], [0], 8, src_index=[2])
    with pytest.raises(KvtierError, match=r"source range \[60, 68\) lies outside its allocation of 64"):
        CopyBatch.create(spaces, dst, [0, 60], [0, 8], 8, src_index=[0, 1])


def test_runs_find_a_constant_stride_and_skip_irregular_entries() -> None:
    src, _ = byte_space(np.zeros(4096, np.uint8))
    dst, _ = byte_space(np.zeros(4096, np.uint8))
    # 4 pieces 100 apart -> 32 apart, then two strays, then 3 pieces again with another step
    so = [0, 100, 200, 300, 1000, 1500, 2000, 2050, 2100]
    do = [0, 32, 64, 96, 500, 900, 1000, 1040, 1080]
    runs = CopyBatch.create(src, dst, so, do, 30).runs()
    assert runs.counts.tolist() == [4, 1, 1, 3]
    assert runs.src_steps.tolist() == [100, 0, 0, 50] and runs.dst_steps.tolist() == [32, 0, 0, 40]
    assert runs.src_offsets.tolist() == [0, 1000, 1500, 2000]


@st.composite
def _batches(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """Random entries with non-overlapping destinations; stretches of constant steps are likely."""
    n = draw(st.integers(0, 40))
    sizes, so, do = [], [], []
    s_pos, d_pos = 0, 0
    step_s, step_d, size = 64, 64, 16
    for _ in range(n):
        if draw(st.integers(0, 3)) == 0:  # change the pattern now and then
            size = draw(st.integers(0, 48))
            step_s = draw(st.integers(0, 96))
            step_d = draw(st.integers(size, 96))
        sizes.append(size)
        so.append(s_pos)
        do.append(d_pos)
        s_pos = max(0, s_pos + step_s - draw(st.integers(0, 1)) * 2 * step_s)  # sources may go back or repeat
        d_pos += max(step_d, size)
    return so, do, sizes


@settings(max_examples=300, deadline=None)
@given(_batches(), st.booleans())
def test_host_backend_copies_exactly_what_single_copies_would(
    entries: tuple[list[int], list[int], list[int]], merge: bool
) -> None:
    so, do, sizes = entries
    src_len = max([s + z for s, z in zip(so, sizes, strict=True)] + [1]) + 8
    src_buf = np.random.default_rng(len(so)).integers(0, 256, src_len, np.uint8)
    dst_len = max([d + z for d, z in zip(do, sizes, strict=True)] + [1]) + 8
    expected = np.zeros(dst_len, np.uint8)
    for s, d, z in zip(so, do, sizes, strict=True):
        expected[d : d + z] = src_buf[s : s + z]
    dst_buf = np.zeros(dst_len, np.uint8)
    src, _ = byte_space(src_buf)
    dst, _ = byte_space(dst_buf)
    batch = CopyBatch.create(src, dst, so, do, sizes)
    if merge:
        batch = batch.merged()
    runs = batch.runs()
    assert int(runs.counts.sum()) == batch.sizes.size, "every entry is in exactly one run"
    HostCopyBackend().run(CopyPlan((batch,), batch.nbytes))
    assert np.array_equal(dst_buf, expected)


def test_block_mapping_rejects_mismatched_layouts_and_ids() -> None:
    pool = aligned_host_array((4, 64))
    rows = aligned_host_array((3, 128))
    device = BlockPieces.from_block_views([pool])
    with pytest.raises(KvtierError, match="piece sizes differ"):
        BlockMapping(device, BlockPieces.from_rows(rows, [0], [32]))
    with pytest.raises(KvtierError, match="reach byte 130 of rows of 128 bytes"):
        BlockPieces.from_rows(rows, [66], [64])
    with pytest.raises(KvtierError, match="must be 2-D"):
        BlockPieces.from_block_views([pool.reshape(-1)])
    mapping = BlockMapping(device, BlockPieces.from_rows(rows, [64], [64]))
    with pytest.raises(KvtierError, match="destination block id 3 is out of range: that side holds 3 blocks"):
        mapping.plan([0], [3])
    with pytest.raises(KvtierError, match="source block id -1"):
        mapping.plan([-1], [0])
    with pytest.raises(KvtierError, match="2 source blocks but 1 destination"):
        mapping.plan([0, 1], [0])
    assert mapping.plan([], []).num_copies == 0


def test_sub_blocks_of_a_row_land_side_by_side() -> None:
    pool = np.arange(6 * 32, dtype=np.uint8).reshape(6, 32)
    rows = aligned_host_array((2, 4 * 32))
    host = BlockPieces.from_rows(rows, [0, 64], [16, 16], blocks_per_row=2, sub_strides=[16, 16])
    device = BlockPieces.from_block_views([pool[:, :16], pool[:, 16:]])
    HostCopyBackend().run(BlockMapping(device, host).plan([5, 2, 0], [1, 2, 3]))
    assert np.array_equal(rows[0, 16:32], pool[5, :16]) and np.array_equal(rows[0, 80:96], pool[5, 16:])
    assert np.array_equal(rows[1, 0:16], pool[2, :16]) and np.array_equal(rows[1, 16:32], pool[0, :16])
    assert not rows[0, :16].any()
