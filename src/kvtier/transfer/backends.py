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

import weakref
from typing import Any, Protocol

import numpy as np

from kvtier.errors import KvtierError
from kvtier.transfer.host import HostBlockCopier, copy_host_batch
from kvtier.transfer.layout import BlockCopyPlan, BlockMapping
from kvtier.transfer.pieces import join_adjacent
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
    """Host-to-host plans, copied on the calling thread (see :mod:`kvtier.transfer.host`).

    A :class:`~kvtier.transfer.layout.BlockCopyPlan` is copied straight from its block
    ids by a :class:`~kvtier.transfer.host.HostBlockCopier` per mapping, built on the
    mapping's first job (or ahead of it: :meth:`TransferEngine.prepare_host
    <kvtier.transfer.engine.TransferEngine.prepare_host>`) and kept while the mapping lives.
    One thread at a time: the transfer engine's copy thread, or its owner while no job is in flight.
    """

    name = "host"

    def __init__(self) -> None:
        self._copiers: weakref.WeakKeyDictionary[BlockMapping, HostBlockCopier] = weakref.WeakKeyDictionary()

    def run(self, plan: CopyPlan) -> None:
        if isinstance(plan, BlockCopyPlan):
            for part in plan.parts:
                self.copier(part.mapping).run(part.src_ids, part.dst_ids)
            return
        for batch in plan.batches:
            copy_host_batch(batch)

    def copier(self, mapping: BlockMapping) -> HostBlockCopier:
        """The executor of ``mapping``'s jobs (built on first use); raises :class:`KvtierError` if a
        side of the mapping is device memory."""
        copier = self._copiers.get(mapping)
        if copier is None:
            if mapping.device != "cpu":
                raise KvtierError(f"a mapping involving {mapping.device} memory cannot be copied by the host backend")
            copier = self._copiers[mapping] = HostBlockCopier(*join_adjacent(mapping.src, mapping.dst))
        return copier


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
