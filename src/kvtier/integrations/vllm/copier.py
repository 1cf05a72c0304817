"""Copies between an engine's KV-cache tensors and rows of the shared region (no vLLM import).

Used by :class:`kvtier.integrations.vllm.worker.KvtierOffloadingWorker` in each
vLLM worker process; every method is called from the worker's main thread.

Byte movement goes through kvtier's own :class:`~kvtier.transfer.TransferEngine`
(the same engine ``kvtier bench`` uses): on CPU tensors a FIFO of plain torch
copies on one owned thread; on CUDA tensors copies on a dedicated stream after
the compute stream, completion tracked with events, with the region page-locked
(``cudaHostRegister``) so the copies are truly asynchronous.

Row layout (see :mod:`kvtier.integrations.vllm.config`): this rank's part of a
row starts at ``rank * rank_bytes``; the KV-cache references of the chunk's
group follow each other there, reference ``i`` holding ``blocks_per_chunk``
sub-blocks of its unpadded page size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.errors import KvtierError
from kvtier.region import SharedRegion
from kvtier.transfer import CopyPair, TransferEngine

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


def block_copy_pairs(
    plans: Sequence[Sequence[RefSlice]],
    device_tensors: Sequence[Any],
    rank_rows: Any,
    device_block_ids: np.ndarray,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slots: np.ndarray,
    blocks_per_chunk: int,
    to_device: bool,
) -> list[CopyPair]:
    """The ``(dst, src)`` copies of one job, one per (device block, reference).

    ``device_block_ids`` are grouped by KV-cache group (``group_sizes``); each
    group's blocks are logically contiguous starting at block index
    ``block_indices[g]``, so the first chunk of a group may be entered part way.
    ``slots`` lists the rows of every group's chunks, group after group.
    ``rank_rows`` is this rank's ``(num_rows, rank_bytes)`` view of the region.
    """
    pairs: list[CopyPair] = []
    block_pos = 0
    slot_pos = 0
    for g, size in enumerate(group_sizes):
        if size == 0:
            continue
        skip = int(block_indices[g]) % blocks_per_chunk
        num_chunks = -(-(skip + size) // blocks_per_chunk)
        if slot_pos + num_chunks > len(slots):
            raise KvtierError(
                f"transfer spec mismatch: group {g} needs {num_chunks} chunk rows after "
                f"{slot_pos}, but only {len(slots)} rows were given"
            )
        group_slots = slots[slot_pos : slot_pos + num_chunks]
        plan = plans[g]
        for i in range(size):
            pos = skip + i
            row = rank_rows[int(group_slots[pos // blocks_per_chunk])]
            sub = pos % blocks_per_chunk
            block_id = int(device_block_ids[block_pos + i])
            for ref in plan:
                start = ref.row_offset + sub * ref.page_bytes
                host = row[start : start + ref.page_bytes]
                dev = device_tensors[ref.tensor_idx][block_id, : ref.page_bytes]
                pairs.append((dev, host) if to_device else (host, dev))
        block_pos += size
        slot_pos += num_chunks
    if block_pos != len(device_block_ids) or slot_pos != len(slots):
        raise KvtierError(
            f"transfer spec mismatch: {len(device_block_ids)} device blocks and {len(slots)} rows "
            f"given, {block_pos} blocks and {slot_pos} rows described by group sizes {list(group_sizes)}"
        )
    return pairs


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
        )
        rows = torch.from_numpy(self.region.rows).view(torch.int8)  # same dtype as vLLM's views
        self._host: Any = rows[:, rank * rank_bytes : (rank + 1) * rank_bytes]
        self.engine = TransferEngine(name=f"kvtier-vllm-copy-{rank}")
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
        pairs = block_copy_pairs(
            self.plans,
            self.device_tensors,
            self._host,
            device_block_ids,
            group_sizes,
            block_indices,
            slots,
            self.blocks_per_chunk,
            to_device,
        )
        self.engine.submit(job_id, pairs)
        return len(pairs)

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued copies, stop the copy thread, drop views, release the mapping. Idempotent."""
        if self._closed:
            return
        start = time.monotonic()
        self.engine.shutdown(timeout)
        self.engine.poll()
        self._host = None
        self.device_tensors = []
        self.region.close()
        self._closed = True
        logger.debug("kvtier worker region %s closed in %.3fs", self.region.name, time.monotonic() - start)
