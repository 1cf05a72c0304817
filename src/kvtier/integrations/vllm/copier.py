"""Copies between an engine's KV-cache tensors and rows of the shared region (no vLLM import).

Used by :class:`kvtier.integrations.vllm.worker.KvtierOffloadingWorker` in each
vLLM worker process; every method is called from the worker's main thread.

Each job is planned once (:class:`ChunkCopyPlanner`: vectorized over blocks and
references) and handed to kvtier's own :class:`~kvtier.transfer.TransferEngine`
(the same engine ``kvtier bench`` uses): CPU tensors are copied by the host
backend on one owned thread; CUDA tensors on a dedicated stream after the
compute stream, by the device backend the worker passes in (vLLM's batched swap
op, :mod:`kvtier.integrations.vllm.swap`), completion tracked with events, with
the region page-locked (``cudaHostRegister``) so the copies are truly asynchronous.

Row layout (see :mod:`kvtier.integrations.vllm.config`): this rank's part of a
row starts at ``rank * rank_bytes``; the KV-cache references of the chunk's
group follow each other there, reference ``i`` holding ``blocks_per_chunk``
sub-blocks of its unpadded page size.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.errors import KvtierError
from kvtier.region import SharedRegion
from kvtier.transfer import BlockCopyPlan, BlockMapping, BlockPieces, CopyBackend, MappedBlocks, TransferEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RefSlice:
    """Where one KV-cache reference of a group lives: device tensor and row bytes."""

    tensor_idx: int
    page_bytes: int
    row_offset: int


def plan_group_layout(
    group_refs: Sequence[Sequence[tuple[int, int]]], blocks_per_chunk: int, rank_bytes: int
) -> list[list[RefSlice]]:
    """Per group, the row offset of each ``(tensor_idx, page_bytes)`` reference.

    Raises :class:`KvtierError` if a group's chunk does not fit in ``rank_bytes``.
    """
    plans: list[list[RefSlice]] = []
    for g, refs in enumerate(group_refs):
        offset = 0
        plan: list[RefSlice] = []
        for tensor_idx, page_bytes in refs:
            plan.append(RefSlice(tensor_idx, page_bytes, offset))
            offset += blocks_per_chunk * page_bytes
        if offset > rank_bytes:
            raise KvtierError(
                f"KV-cache group {g} needs {offset} bytes per chunk, but a rank's part of a row is "
                f"{rank_bytes} bytes: vLLM's worker_kv_bytes_per_block is inconsistent with its tensors"
            )
        plans.append(plan)
    return plans


class ChunkCopyPlanner:
    """Turns vLLM transfer specs into copy plans between device blocks and this rank's part of the rows.

    ``plans[g]`` places group ``g``'s references in a row (:func:`plan_group_layout`);
    ``device_tensors[i]`` is a ``(num_blocks, page_bytes)`` tensor (or array);
    ``rank_rows`` is this rank's ``(num_rows, rank_bytes)`` view of the region.
    The per-group block layouts are built once here; :meth:`plan` is called per
    job on the worker's main thread and costs a few vectorized numpy calls.
    """

    def __init__(
        self,
        plans: Sequence[Sequence[RefSlice]],
        device_tensors: Sequence[Any],
        rank_rows: Any,
        blocks_per_chunk: int,
    ) -> None:
        self.blocks_per_chunk = blocks_per_chunk
        self._to_host: list[BlockMapping | None] = []
        self._to_device: list[BlockMapping | None] = []
        for plan in plans:
            if not plan:
                self._to_host.append(None)
                self._to_device.append(None)
                continue
            device = BlockPieces.from_block_views(
                [device_tensors[ref.tensor_idx] for ref in plan], [ref.page_bytes for ref in plan]
            )
            host = BlockPieces.from_rows(
                rank_rows,
                [ref.row_offset for ref in plan],
                [ref.page_bytes for ref in plan],
                blocks_per_row=blocks_per_chunk,
            )
            self._to_host.append(BlockMapping(device, host))
            self._to_device.append(BlockMapping(host, device))

    def mappings(self) -> list[BlockMapping]:
        """Every block mapping the plans use, to and from the device, groups with tensors only."""
        return [m for m in (*self._to_host, *self._to_device) if m is not None]

    def plan(
        self,
        device_block_ids: np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        slots: np.ndarray,
        to_device: bool,
    ) -> BlockCopyPlan:
        """The copies of one job, every (device block, reference) piece of it.

        ``device_block_ids`` are grouped by KV-cache group (``group_sizes``); each
        group's blocks are logically contiguous starting at block index
        ``block_indices[g]``, so the first chunk of a group may be entered part way.
        ``slots`` lists the rows of every group's chunks, group after group.
        Raises :class:`KvtierError` on a spec that does not add up or an id out of range.
        """
        bpc = self.blocks_per_chunk
        block_ids = np.asarray(device_block_ids, dtype=np.int64).reshape(-1)
        rows = np.asarray(slots, dtype=np.int64).reshape(-1)
        if len(group_sizes) > len(self._to_host):
            raise KvtierError(f"transfer spec has {len(group_sizes)} groups, the KV cache {len(self._to_host)}")
        parts: list[MappedBlocks] = []
        block_pos = 0
        slot_pos = 0
        for g, size in enumerate(group_sizes):
            if size == 0:
                continue
            skip = int(block_indices[g]) % bpc
            num_chunks = -(-(skip + size) // bpc)
            if slot_pos + num_chunks > len(rows) or block_pos + size > len(block_ids):
                raise KvtierError(
                    f"transfer spec mismatch: group {g} needs {num_chunks} chunk rows after {slot_pos} and "
                    f"{size} blocks after {block_pos}, but {len(rows)} rows and {len(block_ids)} blocks were given"
                )
            mapping = self._to_device[g] if to_device else self._to_host[g]
            if mapping is None:
                raise KvtierError(f"transfer spec moves {size} blocks of KV-cache group {g}, which has no tensors")
            pos = skip + np.arange(size, dtype=np.int64)
            host_ids = rows[slot_pos + pos // bpc] * bpc + pos % bpc
            dev_ids = block_ids[block_pos : block_pos + size]
            blocks = mapping.blocks(host_ids, dev_ids) if to_device else mapping.blocks(dev_ids, host_ids)
            if blocks is not None:
                parts.append(blocks)
            block_pos += size
            slot_pos += num_chunks
        if block_pos != len(block_ids) or slot_pos != len(rows):
            raise KvtierError(
                f"transfer spec mismatch: {len(block_ids)} device blocks and {len(rows)} rows "
                f"given, {block_pos} blocks and {slot_pos} rows described by group sizes {list(group_sizes)}"
            )
        return BlockCopyPlan(parts)


class RegionCopier:
    """vLLM-independent core of the worker: owns the region mapping and the transfer engine.

    ``device_tensors[i]`` is a ``(num_blocks, page_bytes)`` int8 tensor (CPU or
    CUDA); ``group_refs[g]`` lists ``(tensor_idx, unpadded_page_bytes)`` of KV
    group ``g``. Attaches to (or creates) the region ``region_name`` with the
    geometry the scheduler uses; blocks up to ``attach_timeout`` while doing so.
    """

    def __init__(
        self,
        *,
        region_name: str,
        shm_dir: str,
        num_rows: int,
        row_bytes: int,
        expected_mappers: int,
        rank: int,
        rank_bytes: int,
        blocks_per_chunk: int,
        device_tensors: Sequence[Any],
        group_refs: Sequence[Sequence[tuple[int, int]]],
        device_backend: CopyBackend | None = None,
    ) -> None:
        import torch

        if rank < 0 or (rank + 1) * rank_bytes > row_bytes:
            raise KvtierError(
                f"rank {rank} with {rank_bytes} bytes per chunk does not fit in rows of {row_bytes} bytes"
            )
        self.blocks_per_chunk = blocks_per_chunk
        self.plans = plan_group_layout(group_refs, blocks_per_chunk, rank_bytes)
        self.device_tensors = list(device_tensors)
        on_cuda = any(t.is_cuda for t in self.device_tensors)
        self.region = SharedRegion(
            region_name,
            num_rows,
            row_bytes,
            expected_mappers=expected_mappers,
            shm_dir=shm_dir,
            prefault=True,
            pin=on_cuda and torch.cuda.is_available(),
            worker=expected_mappers > 1,
        )
        self._started = False  # the region's start seen complete (see submit)
        try:
            self.planner: ChunkCopyPlanner | None = ChunkCopyPlanner(
                self.plans, self.device_tensors, self.region.rows[:, rank * rank_bytes : (rank + 1) * rank_bytes],
                blocks_per_chunk,
            )
        except BaseException as exc:
            # The failed frames hold views of the rows; the mapping cannot close while they live.
            traceback.clear_frames(exc.__traceback__)
            try:
                self.region.close()
            except Exception as close_exc:
                logger.warning("kvtier worker: region %s not released after a failed setup: %s", region_name, close_exc)
            raise
        self.engine = TransferEngine(name=f"kvtier-vllm-copy-{rank}", device_backend=device_backend)
        if not on_cuda:  # host copies: their executors built now, not in the first request's load
            try:
                self.engine.prepare_host(self.planner.mappings())
            except KvtierError as exc:  # not fatal: the first job of a mapping builds its executor
                logger.warning("kvtier worker: host copies not prepared ahead: %s", exc)
        self._closed = False

    def submit(
        self,
        job_id: int,
        device_block_ids: np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        slots: np.ndarray,
        to_device: bool,
    ) -> int:
        """Queue one job; returns its byte count. Raises :class:`KvtierError` on a bad spec."""
        if self.planner is None:
            raise KvtierError("the kvtier worker copier is closed")
        if not self._started:
            # Copies only into a region every expected mapper (the scheduler among them) maps: a
            # worker started after its engine's start completed made a file of its own, and its
            # copies would move bytes no scheduler reads or writes (read once true: then cached).
            self._started = self.region.start_complete()
            if not self._started:
                raise KvtierError(
                    f"region {self.region.name!r} is not mapped by all {self.region.expected_mappers} processes of "
                    "its engine (this worker joined after the engine's start completed, or the scheduler never "
                    "attached): its copies are refused"
                )
        plan = self.planner.plan(device_block_ids, group_sizes, block_indices, slots, to_device)
        self.engine.submit(job_id, plan)
        return plan.nbytes

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued copies, stop the copy thread, drop views, release the mapping. Idempotent."""
        if self._closed:
            return
        start = time.monotonic()
        self.engine.shutdown(timeout)
        self.engine.poll()
        self.planner = None
        self.device_tensors = []
        self.region.close()
        self._closed = True
        logger.debug("kvtier worker region %s closed in %.3fs", self.region.name, time.monotonic() - start)
