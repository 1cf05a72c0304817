"""The worker side: vLLM's ``OffloadingWorker`` over kvtier's region copier.

Runs in each vLLM worker process. vLLM's connector calls ``submit_store`` /
``submit_load`` at the start of a step (before the forward pass),
``get_finished`` once per step, ``wait`` when it must fence blocks
(preemption, block reuse, cache reset) and ``shutdown`` at engine exit, all from
the worker's main thread. ``submit_*`` only plan and enqueue; copies run on the
copy engine (see :mod:`kvtier.integrations.vllm.copier`), on CUDA through vLLM's
batched swap op when this vLLM build has it (:mod:`kvtier.integrations.vllm.swap`).
"""

from __future__ import annotations

import logging

from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvtier.failures import log_failure
from kvtier.integrations.vllm.config import VllmKvtierSettings
from kvtier.integrations.vllm.copier import RegionCopier
from kvtier.integrations.vllm.swap import vllm_swap_backend

logger = logging.getLogger(__name__)

WAIT_TIMEOUT_S = 300.0
"""Upper bound for one ``wait``: a copy that takes longer means a stuck device."""


class KvtierOffloadingWorker(OffloadingWorker):  # type: ignore[misc,unused-ignore]
    """Copies device blocks to and from rows of the shared region for one rank.

    Attaches to the region the scheduler's :class:`TieringManager` creates (or
    creates it first; both sides use the same name and geometry). Blocks at
    construction while attaching and pre-faulting.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, settings: VllmKvtierSettings, rank: int) -> None:
        layout = settings.layout
        tensors = [t.tensor for t in kv_caches.tensors]
        on_device = any(t.is_cuda for t in tensors)
        backend = vllm_swap_backend() if on_device else None
        self.copier = RegionCopier(
            region_name=settings.region_name,
            shm_dir=settings.config.shm_dir,
            num_rows=settings.num_rows,
            row_bytes=layout.row_bytes,
            expected_mappers=settings.expected_mappers,
            rank=rank,
            rank_bytes=layout.rank_bytes,
            blocks_per_chunk=layout.blocks_per_chunk,
            device_tensors=tensors,
            group_refs=[
                [(ref.tensor_idx, ref.page_size_bytes) for ref in refs]
                for refs in kv_caches.group_data_refs
            ],
            device_backend=backend,
        )
        engine = self.copier.engine
        logger.info(
            "kvtier worker rank %d attached to region %s (%d rows of %d bytes, copies: %s backend)",
            rank, settings.region_name, settings.num_rows, layout.row_bytes,
            (engine.device_backend if on_device else engine.host_backend).name,
        )

    def _submit(
        self, job_id: int, device: GPULoadStoreSpec, host: LoadStoreSpec, to_device: bool
    ) -> bool:
        if not isinstance(host, BlockIDsLoadStoreSpec):
            logger.error("job %d: kvtier cannot transfer a %s", job_id, type(host).__name__)
            return False
        try:
            self.copier.submit(
                job_id,
                device.block_ids,
                list(device.group_sizes),
                list(device.block_indices),
                host.block_ids,
                to_device,
            )
        except Exception as exc:
            what = f"job {job_id}: could not queue the kvtier copy"
            log_failure(logger, logging.ERROR, what, exc, with_traceback=True)
            return False
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, to_device=False)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._submit(job_id, dst_spec, src_spec, to_device=True)

    def get_finished(self) -> list[TransferResult]:
        out = []
        for r in self.copier.engine.poll():
            if not r.success:
                logger.error("kvtier copy job %d failed: %s", r.job_id, r.error)
            out.append(TransferResult(r.job_id, r.success, r.bytes_moved, r.seconds))
        return out

    def wait(self, job_ids: set[int]) -> None:
        self.copier.engine.wait(job_ids, timeout=WAIT_TIMEOUT_S)

    def shutdown(self) -> None:
        self.copier.close()
