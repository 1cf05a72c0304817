"""Copy backends: what executes a :class:`~kvtier.transfer.plan.CopyPlan`.

* :class:`HostCopyBackend` -- both sides in host memory (CPU engines, vLLM's
  CPU build, ``kvtier bench``). Copies each strided run of the plan with one
  call: small pieces by ``memoryview`` slice assignment (no GIL hand-off per
  piece), large ones with ``np.copyto`` (which releases the GIL while it
  copies). torch's own CPU copy is avoided on purpose: it fans out over torch's
  intra-op threads and, measured here, slows to a crawl next to a busy Python
  thread.
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

from kvtier.transfer.plan import CopyBatch, CopyPlan

_HOLD_GIL_BYTES = 256 * 1024
"""Pieces below this are copied while holding the GIL: a hand-off per piece costs more than the copy."""


class CopyBackend(Protocol):
    """Executes copy plans; see the module docstring for when and where ``run`` is called."""

    name: str

    def run(self, plan: CopyPlan) -> Any:
        """Perform (host plans) or issue on the current stream (device plans) every copy of ``plan``.

        Returns whatever must stay alive until the issued copies finished
        (descriptor buffers), or None; the engine holds it that long.
        """


def _strided(flat: np.ndarray, offset: int, count: int, size: int, step: int) -> np.ndarray:
    """A ``(count, size)`` view of ``flat`` starting at ``offset``, rows ``step`` bytes apart (bounds-checked)."""
    end = offset + (count - 1) * step + size
    view: np.ndarray = np.ndarray((count, size), dtype=np.uint8, buffer=flat[offset:end], strides=(step, 1))
    return view


def copy_host_batch(batch: CopyBatch) -> None:
    """Copy every entry of a host-to-host batch on the calling thread."""
    src: np.ndarray = batch.src.view
    dst: np.ndarray = batch.dst.view
    runs = batch.runs()
    with src.data as smv, dst.data as dmv:
        for so, do, size, count, ss, ds in zip(
            runs.src_offsets.tolist(),
            runs.dst_offsets.tolist(),
            runs.sizes.tolist(),
            runs.counts.tolist(),
            runs.src_steps.tolist(),
            runs.dst_steps.tolist(),
            strict=True,
        ):
            if count == 1 or (ss == size and ds == size):
                n = size * count
                if n < _HOLD_GIL_BYTES:
                    dmv[do : do + n] = smv[so : so + n]
                else:
                    np.copyto(dst[do : do + n], src[so : so + n], casting="no")
            else:
                np.copyto(_strided(dst, do, count, size, ds), _strided(src, so, count, size, ss), casting="no")


class HostCopyBackend:
    """Host-to-host plans, copied on the calling thread (see the module docstring)."""

    name = "host"

    def run(self, plan: CopyPlan) -> None:
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
            src, dst = _torch_flat(batch.src.view), _torch_flat(batch.dst.view)
            non_blocking = not (batch.src.on_host and batch.dst.on_host)
            for so, do, n in zip(
                batch.src_offsets.tolist(), batch.dst_offsets.tolist(), batch.sizes.tolist(), strict=True
            ):
                dst[do : do + n].copy_(src[so : so + n], non_blocking=non_blocking)
