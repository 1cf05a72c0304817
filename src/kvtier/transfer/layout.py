"""Block layouts: where each block's bytes live on one side of a copy, and the plans between two.

An engine keeps a block's KV bytes as pieces: one page per layer (or per
layer and K/V), each in a per-layer tensor, or all in one tensor laid out
block-major or layer-major. kvtier's CPU rows keep the same pieces side by
side. :class:`BlockPieces` describes one side with per-piece base offsets and
strides; :class:`BlockMapping` pairs two sides and turns block ids into a
:class:`~kvtier.transfer.plan.CopyPlan` with a handful of vectorized numpy
operations, whatever the number of pieces.

Plans are built on the thread that submits the job (the engine worker's main
thread); nothing here blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from kvtier.errors import KvtierError
from kvtier.transfer.host import HostBlockCopier
from kvtier.transfer.plan import ByteSpace, CopyBatch, CopyPlan, byte_space

_INT64 = np.int64


def _row_geometry(view: Any) -> tuple[int, int, int]:
    """``(num_rows, row_bytes, row_stride)`` of a 2-D array or tensor whose rows are contiguous bytes."""
    if isinstance(view, np.ndarray):
        shape, strides, itemsize = view.shape, view.strides, view.itemsize
    else:
        itemsize = view.element_size()
        shape, strides = tuple(view.shape), tuple(s * itemsize for s in view.stride())
    if len(shape) != 2:
        raise KvtierError(f"a block view must be 2-D (blocks, bytes per block), got shape {tuple(shape)}")
    if shape[1] > 1 and strides[1] != itemsize:
        raise KvtierError(f"the bytes of one block must be contiguous; got strides {tuple(strides)}")
    return int(shape[0]), int(shape[1]) * itemsize, int(strides[0])


@dataclass(frozen=True, eq=False)
class BlockPieces:
    """Where piece ``i`` of block ``b`` lives on one side of a copy.

    Bytes ``[offsets[i] + (b // k) * strides[i] + (b % k) * sub_strides[i], + sizes[i])``
    of ``spaces[space_of[i]]``, with ``k = blocks_per_row`` (several engine
    blocks share one CPU row when a row holds a chunk of blocks). ``num_blocks``
    bounds the block ids a plan may use. Build with :meth:`from_block_views` or
    :meth:`from_rows`.
    """

    spaces: tuple[ByteSpace, ...]
    space_of: np.ndarray
    offsets: np.ndarray
    strides: np.ndarray
    sub_strides: np.ndarray
    sizes: np.ndarray
    num_blocks: int
    blocks_per_row: int = 1
    _single: tuple[int, int] = field(default=(0, 0), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The single-piece geometry as Python ints, for the per-job fast path of piece_offsets.
        object.__setattr__(self, "_single", (int(self.strides[0]), int(self.offsets[0])) if self.sizes.size else (0, 0))

    @property
    def num_pieces(self) -> int:
        return int(self.sizes.size)

    @classmethod
    def from_block_views(cls, views: Sequence[Any], sizes: Sequence[int] | None = None) -> BlockPieces:
        """Piece ``i`` is the first ``sizes[i]`` bytes (default: all) of each row of ``views[i]``.

        Each view is a ``(num_blocks, bytes)`` numpy array or torch tensor with
        contiguous rows, e.g. vLLM's per-layer ``(num_blocks, page_bytes)`` int8
        views. Views of one allocation share one space, so a backend may join
        their copies. Raises :class:`KvtierError` on another shape.
        """
        if not views:
            raise KvtierError("a block layout needs at least one view")
        if sizes is not None and len(sizes) != len(views):
            raise KvtierError(f"{len(sizes)} piece sizes given for {len(views)} views")
        spaces: list[ByteSpace] = []
        index: dict[tuple[int, int, str], int] = {}
        space_of, offsets, strides, piece_sizes, counts = [], [], [], [], []
        for i, view in enumerate(views):
            num, row_bytes, stride = _row_geometry(view)
            size = row_bytes if sizes is None else int(sizes[i])
            if not 0 <= size <= row_bytes:
                raise KvtierError(f"piece {i} of {size} bytes does not fit in a block row of {row_bytes} bytes")
            space, offset = byte_space(view)
            key = (space.address, space.nbytes, space.device)
            if key not in index:
                index[key] = len(spaces)
                spaces.append(space)
            space_of.append(index[key])
            offsets.append(offset)
            strides.append(stride)
            piece_sizes.append(size)
            counts.append(num)
        return cls(
            tuple(spaces),
            np.asarray(space_of, _INT64),
            np.asarray(offsets, _INT64),
            np.asarray(strides, _INT64),
            np.zeros(len(views), _INT64),
            np.asarray(piece_sizes, _INT64),
            min(counts),
        )

    @classmethod
    def from_rows(
        cls,
        rows: Any,
        piece_offsets: Sequence[int],
        piece_sizes: Sequence[int],
        *,
        blocks_per_row: int = 1,
        sub_strides: Sequence[int] | None = None,
    ) -> BlockPieces:
        """Pieces inside the rows of one ``(num_rows, row_bytes)`` array: piece ``i`` at ``piece_offsets[i]``.

        With ``blocks_per_row = k > 1`` block ``b`` lives in row ``b // k`` and
        its piece ``i`` sits ``(b % k) * sub_strides[i]`` bytes further (default
        sub stride: the piece size). Raises :class:`KvtierError` if a piece can
        reach past the end of a row.
        """
        num_rows, row_bytes, row_stride = _row_geometry(rows)
        if blocks_per_row < 1:
            raise KvtierError(f"blocks_per_row must be >= 1, got {blocks_per_row}")
        offs = np.asarray(piece_offsets, _INT64)
        sizes = np.asarray(piece_sizes, _INT64)
        subs = sizes.copy() if sub_strides is None else np.asarray(sub_strides, _INT64)
        if not (offs.shape == sizes.shape == subs.shape) or offs.ndim != 1 or not offs.size:
            raise KvtierError(
                f"row pieces need matching offsets, sizes and sub strides; got {offs.size}, {sizes.size}, {subs.size}"
            )
        reach = offs + (blocks_per_row - 1) * subs + sizes
        if int(offs.min()) < 0 or int(sizes.min()) < 0 or int(subs.min()) < 0 or int(reach.max()) > row_bytes:
            raise KvtierError(
                f"row pieces reach byte {int(reach.max())} of rows of {row_bytes} bytes "
                f"(offsets {offs.tolist()}, sizes {sizes.tolist()}, {blocks_per_row} blocks per row)"
            )
        space, base = byte_space(rows)
        n = offs.size
        return cls(
            (space,),
            np.zeros(n, _INT64),
            offs + base,
            np.full(n, row_stride, _INT64),
            subs,
            sizes,
            num_rows * blocks_per_row,
            blocks_per_row,
        )

    def piece_offsets(self, block_ids: np.ndarray) -> np.ndarray:
        """``(len(block_ids), num_pieces)`` byte offsets of every piece of every block (C order)."""
        k = self.blocks_per_row
        out: np.ndarray
        if k == 1 and self.offsets.size == 1:  # one piece: scalar arithmetic is cheaper than broadcasting
            stride, offset = self._single
            out = block_ids * stride
            out += offset
            return out
        ids = block_ids[:, None]
        if k == 1:
            out = self.offsets + ids * self.strides
        else:
            out = self.offsets + (ids // k) * self.strides + (ids % k) * self.sub_strides
        return out

    def check_ids(self, block_ids: Any, what: str) -> np.ndarray:
        """``block_ids`` as a 1-D int64 array; raises :class:`KvtierError` on a non-integer or out-of-range id."""
        ids = np.asarray(block_ids)
        if ids.ndim != 1:
            ids = ids.reshape(-1)
        if ids.dtype != _INT64:
            if ids.size and ids.dtype.kind not in "iu":
                raise KvtierError(f"{what} block ids must be integers, got dtype {ids.dtype}")
            ids = ids.astype(_INT64)
        if not ids.size:
            return ids
        if ids.size <= 32:  # a Python min/max beats two numpy reductions on short arrays
            values = ids.tolist()
            lo, hi = min(values), max(values)
        else:
            lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.num_blocks:
            bad = lo if lo < 0 else hi
            raise KvtierError(f"{what} block id {bad} is out of range: that side holds {self.num_blocks} blocks")
        return ids


def join_adjacent(src: BlockPieces, dst: BlockPieces) -> tuple[BlockPieces, BlockPieces]:
    """Both layouts with every run of pieces that follow each other on both sides joined into one piece.

    Pieces ``i`` and ``i + 1`` join when, on each side, they lie in one space,
    piece ``i + 1`` starts where piece ``i`` ends, and both advance alike from
    block to block (equal strides, and equal sub strides where a row holds
    several blocks), so they stay adjacent in every block: a block-major cache
    and its rows become one piece per block. The layouts must pair (see
    :class:`BlockMapping`).
    """
    keep = [0]
    for i in range(1, src.num_pieces):
        if not (_continues(src, i) and _continues(dst, i)):
            keep.append(i)
    if len(keep) == src.num_pieces:
        return src, dst
    starts = np.asarray(keep, _INT64)
    sizes = np.add.reduceat(src.sizes, starts)

    def joined(side: BlockPieces) -> BlockPieces:
        return replace(
            side,
            space_of=side.space_of[starts],
            offsets=side.offsets[starts],
            strides=side.strides[starts],
            sub_strides=side.sub_strides[starts],
            sizes=sizes,
        )

    return joined(src), joined(dst)


def _continues(side: BlockPieces, i: int) -> bool:
    """True if piece ``i`` of ``side`` starts where piece ``i - 1`` ends, in every block."""
    j = i - 1
    return bool(
        side.space_of[i] == side.space_of[j]
        and side.offsets[i] == side.offsets[j] + side.sizes[j]
        and side.strides[i] == side.strides[j]
        and (side.blocks_per_row == 1 or side.sub_strides[i] == side.sub_strides[j])
    )


class MappedBlocks(NamedTuple):
    """Checked block ids of one job through one :class:`BlockMapping`: ``src_ids[j]`` goes to ``dst_ids[j]``."""

    mapping: BlockMapping
    src_ids: np.ndarray
    dst_ids: np.ndarray


class BlockMapping:
    """Whole-block copies from one :class:`BlockPieces` layout to another; plan per job with :meth:`plan`.

    Piece ``i`` of a source block goes to piece ``i`` of its destination block
    (sizes must match). A job becomes one batch, whatever the number of
    allocations, its entries ordered block by block, so the pieces of one
    block can join into one copy (or one strided run) where both sides keep
    them adjacent (or evenly spaced). ``device`` is ``"cpu"`` when both sides
    are host memory, else the device involved.
    """

    def __init__(self, src: BlockPieces, dst: BlockPieces) -> None:
        if src.num_pieces != dst.num_pieces:
            raise KvtierError(f"source blocks have {src.num_pieces} pieces, destination blocks {dst.num_pieces}")
        if not np.array_equal(src.sizes, dst.sizes):
            raise KvtierError(
                f"piece sizes differ between source {src.sizes.tolist()} and destination {dst.sizes.tolist()}"
            )
        self.src = src
        self.dst = dst
        self.block_bytes = int(src.sizes.sum())
        self.device = next((s.device for s in (*src.spaces, *dst.spaces) if not s.on_host), "cpu")
        # Per-entry space indexes and sizes repeat block after block: kept for the largest job so far,
        # and sliced per job (batches never write to their arrays).
        self._columns: tuple[np.ndarray, ...] = (np.zeros(0, _INT64),) * 3
        self._host: HostBlockCopier | None = None

    def blocks(self, src_ids: Any, dst_ids: Any) -> MappedBlocks | None:
        """The checked ids of copying block ``src_ids[j]`` to block ``dst_ids[j]`` for every ``j`` (None if empty).

        Raises :class:`KvtierError` if the id lists differ in length or an id is
        out of range on its side.
        """
        s_ids = self.src.check_ids(src_ids, "source")
        d_ids = self.dst.check_ids(dst_ids, "destination")
        if s_ids.size != d_ids.size:
            raise KvtierError(f"{s_ids.size} source blocks but {d_ids.size} destination blocks")
        return MappedBlocks(self, s_ids, d_ids) if s_ids.size else None

    def batch(self, src_ids: Any, dst_ids: Any) -> CopyBatch | None:
        """The batch copying block ``src_ids[j]`` to block ``dst_ids[j]`` for every ``j`` (None if empty).

        Raises like :meth:`blocks`.
        """
        blocks = self.blocks(src_ids, dst_ids)
        return None if blocks is None else self.batch_of(blocks)

    def batch_of(self, blocks: MappedBlocks) -> CopyBatch:
        """The batch of ids :meth:`blocks` checked: one entry per (block, piece), block by block."""
        s_ids, d_ids = blocks.src_ids, blocks.dst_ids
        entries = s_ids.size * self.src.num_pieces
        if self._columns[0].size < entries:
            rows = max(entries, 2 * self._columns[0].size) // self.src.num_pieces + 1
            self._columns = tuple(np.tile(a, rows) for a in (self.src.space_of, self.dst.space_of, self.src.sizes))
        src_index, dst_index, sizes = (a[:entries] for a in self._columns)
        # Ids were checked against layouts whose pieces were checked against their
        # allocations, so every entry is in bounds: the batch skips CopyBatch.create's checks.
        return CopyBatch(
            self.src.spaces,
            self.dst.spaces,
            src_index,
            dst_index,
            self.src.piece_offsets(s_ids).reshape(-1),
            self.dst.piece_offsets(d_ids).reshape(-1),
            sizes,
        )

    def plan(self, src_ids: Any, dst_ids: Any) -> CopyPlan:
        """One job's plan (a :class:`BlockCopyPlan`; an empty plan for no blocks); raises like :meth:`blocks`."""
        blocks = self.blocks(src_ids, dst_ids)
        return CopyPlan((), 0) if blocks is None else BlockCopyPlan((blocks,))

    def host_copier(self) -> HostBlockCopier:
        """The executor of this mapping's host jobs (built on first use; raises if a side is on a device)."""
        if self._host is None:
            if self.device != "cpu":
                raise KvtierError(f"a mapping involving {self.device} memory cannot be copied by the host backend")
            self._host = HostBlockCopier(*join_adjacent(self.src, self.dst))
        return self._host


class BlockCopyPlan(CopyPlan):
    """A job of whole blocks through one or more mappings (one per KV-cache group): checked ids only.

    Built on the submitting thread at the cost of the id checks; the host
    backend copies it straight from the ids (:meth:`copy_on_host`), and its
    batches, which device backends read, are built on first use.
    """

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence[MappedBlocks]) -> None:
        self.parts = tuple(parts)
        self._batches = None
        self.nbytes = 0
        for part in self.parts:
            self.nbytes += part.src_ids.size * part.mapping.block_bytes

    @property
    def batches(self) -> tuple[CopyBatch, ...]:
        if self._batches is None:
            self._batches = tuple(p.mapping.batch_of(p) for p in self.parts)
        return self._batches

    @property
    def num_copies(self) -> int:
        return sum(int(p.src_ids.size) * p.mapping.src.num_pieces for p in self.parts)

    @property
    def device(self) -> str:
        return next((p.mapping.device for p in self.parts if p.mapping.device != "cpu"), "cpu")

    def copy_on_host(self) -> None:
        """Copy every block on the calling thread (host memory on both sides; see :mod:`kvtier.transfer.host`)."""
        for part in self.parts:
            part.mapping.host_copier().run(part.src_ids, part.dst_ids)
