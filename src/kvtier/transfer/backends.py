"""Copy backends: what executes a :class:`~kvtier.transfer.plan.CopyPlan`.

* :class:`HostCopyBackend` -- both sides in host memory (CPU engines, vLLM's
  CPU build, ``kvtier bench``): :mod:`kvtier.transfer.host` copies the evenly
  spaced pieces of a block (its layers) with one strided ``np.copyto`` and
  others with one call each (``np.copyto``, which releases the GIL, for the
  largest); plans of a :class:`~kvtier.transfer.layout.BlockMapping` are
  copied straight from their block ids. torch's own CPU copy is avoided on purpose: it fans out over
  torch's intra-op threads and, measured here, slows to a crawl next to a busy
  Python thread.
* :class:`TorchCopyBackend` -- a device is involved and nothing better is
  available: one ``Tensor.copy_`` per merged entry, issued on the current CUDA
  stream.
* The vLLM integration adds a backend over vLLM's batched swap op (one driver
  call per job); see :mod:`kvtier.integrations.vllm.swap`.

A backend's :meth:`~CopyBackend.run` is called by the
:class:`~kvtier.transfer.engine.TransferEngine`: for host plans on its copy
thread (the copy is done when ``run`` returns), for device plans on the
submitting thread inside the engine's CUDA stream (``run`` only issues).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from kvtier.transfer.host import copy_host_batch
from kvtier.transfer.layout import BlockCopyPlan
from kvtier.transfer.plan import CopyPlan


class CopyBackend(Protocol):
    """Executes copy plans; see the module docstring for when and where ``run`` is called."""

    name: str

    def run(self, plan: CopyPlan) -> Any:
        """Perform (host plans) or issue on the current stream (device plans) every copy of ``plan``.

        Returns whatever must stay alive until the issued copies finished
        (descriptor buffers), or None; the engine holds it that long.
        """


class HostCopyBackend:
    """Host-to-host plans, copied on the calling thread (see :mod:`kvtier.transfer.host`)."""

    name = "host"

    def run(self, plan: CopyPlan) -> None:
        if isinstance(plan, BlockCopyPlan):
            plan.copy_on_host()
            return
        for batch in plan.batches:
            copy_host_batch(batch)


def _torch_flat(view: Any) -> Any:
    import torch

    return torch.from_numpy(view) if isinstance(view, np.ndarray) else view


class TorchCopyBackend:
    """Device plans as one ``Tensor.copy_`` per merged entry on the current stream (the portable fallback)."""

    name = "torch"

    def run(self, plan: CopyPlan) -> None:
        for batch in plan.batches:
            merged = batch.merged()
            srcs = [_torch_flat(space.view) for space in batch.src_spaces]
            dsts = [_torch_flat(space.view) for space in batch.dst_spaces]
            for si, di, so, do, n in zip(
                merged.src_index.tolist(),
                merged.dst_index.tolist(),
                merged.src_offsets.tolist(),
                merged.dst_offsets.tolist(),
                merged.sizes.tolist(),
                strict=True,
            ):
                dsts[di][do : do + n].copy_(srcs[si][so : so + n], non_blocking=True)
