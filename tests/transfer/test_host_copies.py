"""Host execution of block plans: every fast path copies exactly what one copy per (block, piece) would.

Covers the paths of :class:`kvtier.transfer.host.HostBlockCopier` (strided runs
of evenly spaced pieces, one call per other piece with Python-int offsets for
small jobs and numpy offsets otherwise, joined continuations, the GIL-releasing copy of
large pieces) over the layouts engines use: block-major, layer-major, per-layer
K/V tensors (evenly and unevenly spaced, one allocation or many), one and two
blocks per row, stores and loads.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.region import SharedRegion
from kvtier.transfer import (
    BlockCopyPlan,
    BlockMapping,
    BlockPieces,
    HostCopyBackend,
    TransferEngine,
    aligned_host_array,
    join_adjacent,
)
from kvtier.transfer.host import HOLD_GIL_BYTES, PieceRun, joined_ranges, piece_runs


def _naive(src: BlockPieces, dst: BlockPieces, src_ids: list[int], dst_ids: list[int]) -> None:
    """The reference: one slice assignment per (block, piece), geometry read straight off the layouts."""
    for bs, bd in zip(src_ids, dst_ids, strict=True):
        for i in range(src.num_pieces):
            z = int(src.sizes[i])
            so = _at(src, i, bs)
            do = _at(dst, i, bd)
            dst.spaces[int(dst.space_of[i])].view[do : do + z] = src.spaces[int(src.space_of[i])].view[so : so + z]


def _at(side: BlockPieces, i: int, block: int) -> int:
    k = side.blocks_per_row
    return int(side.offsets[i]) + (block // k) * int(side.strides[i]) + (block % k) * int(side.sub_strides[i])


def _snapshot(side: BlockPieces) -> list[np.ndarray]:
    return [space.view.copy() for space in side.spaces]


def _restore(side: BlockPieces, saved: list[np.ndarray]) -> None:
    for space, data in zip(side.spaces, saved, strict=True):
        space.view[:] = data


def _check_against_naive(src: BlockPieces, dst: BlockPieces, src_ids: list[int], dst_ids: list[int]) -> None:
    """Run the job through the host backend and through :func:`_naive` from the same start; compare every byte."""
    before = _snapshot(dst)
    _naive(src, dst, src_ids, dst_ids)
    want = _snapshot(dst)
    _restore(dst, before)
    plan = BlockMapping(src, dst).plan(np.asarray(src_ids), np.asarray(dst_ids))
    HostCopyBackend().run(plan)
    for got, expected in zip(_snapshot(dst), want, strict=True):
        assert np.array_equal(got, expected)


# --- layouts -------------------------------------------------------------------------------------

NUM_BLOCKS, PAGE, LAYERS = 24, 2048, 4
rng = np.random.default_rng(7)


def _random(shape: tuple[int, ...]) -> np.ndarray:
    arr = aligned_host_array(shape)
    arr[...] = rng.integers(0, 256, shape, dtype=np.uint8)
    return arr


def _block_major(page: int) -> list[np.ndarray]:
    pool = _random((NUM_BLOCKS, LAYERS, 2, page))
    return [pool[:, i].reshape(NUM_BLOCKS, 2 * page) for i in range(LAYERS)]


def _layer_major(page: int) -> list[np.ndarray]:
    pool = _random((LAYERS, 2, NUM_BLOCKS, page))
    return [pool[i, kv] for i in range(LAYERS) for kv in range(2)]


def _per_layer_kv(page: int) -> list[np.ndarray]:
    """Separate allocations (raw spans), usually equally spaced: allocated one after the other."""
    return [_random((NUM_BLOCKS, page)) for _ in range(2 * LAYERS)]


def _per_layer_kv_uneven(page: int) -> list[np.ndarray]:
    """One allocation carved into per-layer K/V tensors at irregular distances (no strided run forms)."""
    gaps = [64 * (i * i % 5 + 1) for i in range(2 * LAYERS)]
    buf = _random((sum(gaps) + 2 * LAYERS * NUM_BLOCKS * page,))
    views, at = [], 0
    for gap in gaps:
        at += gap
        views.append(buf[at : at + NUM_BLOCKS * page].reshape(NUM_BLOCKS, page))
        at += NUM_BLOCKS * page
    return views


def _per_layer_kv_downwards(page: int) -> list[np.ndarray]:
    """Equally spaced tensors placed at decreasing addresses (as large allocations are mapped): negative steps."""
    buf = _random((2 * LAYERS * NUM_BLOCKS * page,))
    return [
        buf[i * NUM_BLOCKS * page : (i + 1) * NUM_BLOCKS * page].reshape(NUM_BLOCKS, page)
        for i in reversed(range(2 * LAYERS))
    ]


LAYOUTS: dict[str, Callable[[int], list[np.ndarray]]] = {
    "block-major": _block_major,
    "layer-major": _layer_major,
    "per-layer K/V": _per_layer_kv,
    "per-layer K/V, uneven": _per_layer_kv_uneven,
    "per-layer K/V, downwards": _per_layer_kv_downwards,
}


def _host_side(views: list[np.ndarray], bpc: int, num_rows: int) -> BlockPieces:
    """Rows holding ``bpc`` blocks each, reference after reference (the vLLM integration's row layout)."""
    sizes = [int(v.shape[1]) for v in views]
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])) * bpc
    rows = _random((num_rows, bpc * sum(sizes) + 128))
    return BlockPieces.from_rows(rows, offsets.tolist(), sizes, blocks_per_row=bpc)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("bpc", [1, 2])
@pytest.mark.parametrize("page", [PAGE, 12 * 1024])
@pytest.mark.parametrize("num", [1, 2, 5, 19])  # Python-int offsets up to 16 copies, numpy beyond
def test_store_and_load_match_one_copy_per_piece(layout: str, bpc: int, page: int, num: int) -> None:
    device = BlockPieces.from_block_views(LAYOUTS[layout](page))
    host = _host_side(LAYOUTS[layout](page), bpc, num_rows=NUM_BLOCKS)
    dev_ids = rng.choice(NUM_BLOCKS, num, replace=False).tolist()
    host_ids = rng.choice(NUM_BLOCKS * bpc, num, replace=False).tolist()
    _check_against_naive(device, host, dev_ids, host_ids)
    _check_against_naive(host, device, host_ids, dev_ids)


def test_consecutive_blocks_in_consecutive_rows_join_into_one_copy() -> None:
    pool, rows = _random((16, 4096)), _random((16, 4096))
    device, host = BlockPieces.from_block_views([pool]), BlockPieces.from_rows(rows, [0], [4096])
    at = np.asarray([3, 4, 5, 9]) * 4096
    assert joined_ranges(at, at + 2 * 4096, np.full(4, 4096)) == (
        [3 * 4096, 9 * 4096], [5 * 4096, 11 * 4096], [3 * 4096, 4096]
    ), "blocks 3-5 go to rows 5-7: one copy"
    assert joined_ranges(at, at[::-1].copy(), np.full(4, 4096))[2] == [4096] * 4
    _check_against_naive(device, host, [3, 4, 5, 9], [5, 6, 7, 11])  # Python-int offsets
    _check_against_naive(device, host, list(range(16)), [*range(2, 16), 0, 1])  # numpy offsets
    _check_against_naive(host, device, [5, 6, 7, 11], [3, 4, 5, 9])


def test_large_pieces_are_copied_outside_the_gil_and_exactly() -> None:
    big = HOLD_GIL_BYTES + 4096
    views = [_random((3, big)) for _ in range(2)]
    host = _host_side(views, 1, num_rows=3)
    _check_against_naive(BlockPieces.from_block_views(views), host, [2, 0], [0, 1])


def test_plans_build_their_batches_only_when_asked() -> None:
    views = _per_layer_kv(PAGE)
    mapping = BlockMapping(BlockPieces.from_block_views(views), _host_side(views, 2, NUM_BLOCKS))
    plan = mapping.plan([3, 4, 9], [0, 1, 5])
    assert isinstance(plan, BlockCopyPlan) and plan.device == "cpu" and plan.on_host
    assert plan.nbytes == 3 * 2 * LAYERS * PAGE and plan.num_copies == 3 * 2 * LAYERS
    assert plan._batches is None, "nothing above needed the batches"
    (batch,) = plan.batches
    expected = mapping.batch([3, 4, 9], [0, 1, 5])
    assert expected is not None
    for name in ("src_index", "dst_index", "src_offsets", "dst_offsets", "sizes"):
        assert np.array_equal(getattr(batch, name), getattr(expected, name))
    assert mapping.plan([], []).num_copies == 0


def test_adjacent_pieces_join_only_where_both_sides_keep_them_adjacent() -> None:
    pool = _random((8, 4, 256))
    views = [pool[:, i] for i in range(4)]
    rows = _random((8, 4 * 256))
    device = BlockPieces.from_block_views(views)
    joined_src, joined_dst = join_adjacent(device, BlockPieces.from_rows(rows, [0, 256, 512, 768], [256] * 4))
    assert joined_src.num_pieces == joined_dst.num_pieces == 1 and joined_src.sizes.tolist() == [1024]
    # Rows keep piece 2 before piece 1: only pieces 0-1 stay together on the device side... and 2-3 nowhere.
    swapped = BlockPieces.from_rows(rows, [0, 512, 256, 768], [256] * 4)
    src, dst = join_adjacent(device, swapped)
    assert src.num_pieces == 4 and dst.offsets.tolist() == swapped.offsets.tolist()
    # Two blocks per row, each reference holding both blocks' pages: not adjacent within a block.
    two_per_row = BlockPieces.from_rows(_random((4, 4 * 512)), [0, 512, 1024, 1536], [256] * 4, blocks_per_row=2)
    assert join_adjacent(device, two_per_row)[0].num_pieces == 4
    _check_against_naive(device, two_per_row, [7, 0, 3], [1, 2, 7])


def test_evenly_spaced_pieces_form_strided_runs_in_either_direction() -> None:
    for maker, step in ((_layer_major, NUM_BLOCKS * PAGE), (_per_layer_kv_downwards, -NUM_BLOCKS * PAGE)):
        views = maker(PAGE)
        src, dst = join_adjacent(BlockPieces.from_block_views(views), _host_side(views, 1, NUM_BLOCKS))
        assert piece_runs(src, dst) == [PieceRun(0, 2 * LAYERS, step, PAGE)]
        assert piece_runs(dst, src) == [PieceRun(0, 2 * LAYERS, PAGE, step)]
    views = _per_layer_kv_uneven(PAGE)
    src, dst = BlockPieces.from_block_views(views), _host_side(views, 1, NUM_BLOCKS)
    assert [run.length for run in piece_runs(src, dst)] == [1] * 2 * LAYERS
    # With two blocks per row the references are 2 pages apart in a row: still one run.
    views = _layer_major(PAGE)
    src, dst = BlockPieces.from_block_views(views), _host_side(views, 2, NUM_BLOCKS)
    assert piece_runs(src, dst) == [PieceRun(0, 2 * LAYERS, NUM_BLOCKS * PAGE, 2 * PAGE)]


# --- random layouts and jobs ---------------------------------------------------------------------

SIZES = [1, 24, 100, 2048, 8192, 8200, 20000]


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[BlockPieces, BlockPieces, list[int], list[int]]:
    """A device layout (one of several shapes), a row layout with 1-3 blocks per row, and a job."""
    num_pieces = draw(st.integers(1, 5))
    same_size = draw(st.booleans())
    first = draw(st.sampled_from(SIZES))
    sizes = [first if same_size else draw(st.sampled_from(SIZES)) for _ in range(num_pieces)]
    num_blocks = draw(st.integers(1, 12))
    kind = draw(st.sampled_from(["separate", "carved", "block-major", "layer-major"]))
    views: list[np.ndarray]
    if kind == "separate":
        views = [_random((num_blocks, z)) for z in sizes]
    elif kind == "carved":
        even = draw(st.booleans())
        gaps = [64 if even else draw(st.integers(0, 4)) * 64 for _ in sizes]
        buf = _random((sum(gaps) + num_blocks * sum(sizes),))
        views, at = [], 0
        for gap, z in zip(gaps, sizes, strict=True):
            at += gap
            views.append(buf[at : at + num_blocks * z].reshape(num_blocks, z))
            at += num_blocks * z
        if draw(st.booleans()):
            views.reverse()
            sizes.reverse()
    elif kind == "block-major":
        pool = _random((num_blocks, sum(sizes)))
        edges = np.concatenate(([0], np.cumsum(sizes)))
        views = [pool[:, int(a) : int(b)] for a, b in itertools.pairwise(edges.tolist())]
    else:
        pool = _random((num_pieces, num_blocks, max(sizes)))
        views = [pool[i, :, : sizes[i]] for i in range(num_pieces)]
    device = BlockPieces.from_block_views(views)
    bpc = draw(st.integers(1, 3))
    padding = draw(st.sampled_from([0, 16]))
    offsets, at = [], 0
    for z in sizes:
        offsets.append(at)
        at += bpc * z + padding
    num_rows = draw(st.integers(1, 6))
    host = BlockPieces.from_rows(_random((num_rows, at + 8)), offsets, sizes, blocks_per_row=bpc)
    n = draw(st.integers(1, min(num_blocks, num_rows * bpc)))
    dev_ids = draw(st.permutations(range(num_blocks)))[:n]
    host_ids = draw(st.permutations(range(num_rows * bpc)))[:n]
    return device, host, list(dev_ids), list(host_ids)


@settings(max_examples=300, deadline=None)
@given(_layouts(), st.booleans())
def test_random_block_plans_copy_exactly_what_one_copy_per_piece_would(
    case: tuple[BlockPieces, BlockPieces, list[int], list[int]], load: bool
) -> None:
    device, host, dev_ids, host_ids = case
    if load:
        _check_against_naive(host, device, host_ids, dev_ids)
    else:
        _check_against_naive(device, host, dev_ids, host_ids)


# --- lifetime ------------------------------------------------------------------------------------


@pytest.mark.usefixtures("shm_leak_check")
def test_region_closes_after_host_jobs_once_the_mappings_are_dropped() -> None:
    region = SharedRegion("host-copies", 8, LAYERS * PAGE)
    views = _per_layer_kv(PAGE)[:LAYERS]
    rows = region.rows
    host = BlockPieces.from_rows(rows, [i * PAGE for i in range(LAYERS)], [PAGE] * LAYERS)
    mapping = BlockMapping(BlockPieces.from_block_views(views), host)
    engine = TransferEngine()
    try:
        engine.submit(1, mapping.plan([5, 6, 7], [0, 3, 1]))
        engine.wait([1], timeout=10)
        (result,) = engine.poll()
        assert result.success and result.bytes_moved == 3 * LAYERS * PAGE
        assert bytes(rows[3]) == b"".join(bytes(v[6]) for v in views)
    finally:
        engine.shutdown()
    del rows, host, mapping
    region.close()


@pytest.mark.usefixtures("shm_leak_check")
def test_prepared_mappings_build_no_executor_in_their_first_job(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.transfer.backends as backends

    built: list[int] = []  # counts only: the arguments are views of the rows
    real = backends.HostBlockCopier

    def counting(*args: object) -> object:
        built.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(backends, "HostBlockCopier", counting)
    region = SharedRegion("host-prepared", 8, LAYERS * PAGE)
    views = _per_layer_kv(PAGE)[:LAYERS]
    rows = region.rows
    host = BlockPieces.from_rows(rows, [i * PAGE for i in range(LAYERS)], [PAGE] * LAYERS)
    device = BlockPieces.from_block_views(views)
    to_host, to_device = BlockMapping(device, host), BlockMapping(host, device)
    engine = TransferEngine()
    try:
        engine.prepare_host([to_host, to_device])
        assert len(built) == 2
        engine.submit(1, to_host.plan([5, 6], [2, 4]))
        engine.submit(2, to_device.plan([2], [1]))
        engine.wait([1, 2], timeout=10)
        assert all(r.success for r in engine.poll())
        assert len(built) == 2, "the first jobs used the executors built ahead"
        assert bytes(rows[4]) == b"".join(bytes(v[6]) for v in views)
        assert all(bytes(v[1]) == bytes(v[5]) for v in views)
    finally:
        engine.shutdown()
    del rows, host, device, to_host, to_device
    region.close()  # the executors built ahead are let go with their mappings
