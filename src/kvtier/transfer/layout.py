"""Block mappings: the plans of whole-block copies between two layouts.

A layout (:class:`~kvtier.transfer.pieces.BlockPieces`) says where each piece
of a block lives on one side of a copy; :class:`BlockMapping` pairs two sides
and turns block ids into a :class:`~kvtier.transfer.plan.CopyPlan` with a
handful of vectorized numpy operations, whatever the number of pieces. How a
plan is executed is the backends' business (:mod:`kvtier.transfer.backends`).

Plans are built on the thread that submits the job (the engine worker's main
thread); nothing here blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kvtier.errors import KvtierError
from kvtier.transfer.pieces import BlockPieces
from kvtier.transfer.plan import CopyBatch, CopyPlan

_INT64 = np.int64


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


class BlockCopyPlan(CopyPlan):
    """A job of whole blocks through one or more mappings (one per KV-cache group): checked ids only.

    Built on the submitting thread at the cost of the id checks; the host
    backend copies it straight from the ids (``parts``), and its batches, which
    device backends read, are built on first use.
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
