"""Block pieces: where each block's bytes live on one side of a copy.

An engine keeps a block's KV bytes as pieces: one page per layer (or per
layer and K/V), each in a per-layer tensor, or all in one tensor laid out
block-major or layer-major. kvtier's CPU rows keep the same pieces side by
side. :class:`BlockPieces` describes one side with per-piece base offsets and
strides; :func:`join_adjacent` joins the pieces that follow each other on both
sides of a copy. Pairs of sides are planned in :mod:`kvtier.transfer.layout` and
copied by the backends (:mod:`kvtier.transfer.backends`); this module is what
both share, so neither imports the other.

Built on the thread that sets up a worker's copies; nothing here blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvtier.errors import KvtierError
from kvtier.transfer.plan import ByteSpace, byte_space

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


__all__ = ["BlockPieces", "join_adjacent"]
