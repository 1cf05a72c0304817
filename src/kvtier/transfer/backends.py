"""Copy backends: what executes a :class:`~kvtier.transfer.plan.CopyPlan`.

* :class:`HostCopyBackend` -- both sides in host memory (CPU engines, vLLM's
  CPU build, ``kvtier bench``). Copies each strided run of the plan with one
  call: small pieces by ``memoryview`` slice assignment (no GIL hand-off per
  piece), large ones with ``np.copyto`` (which releases the GIL while it
  copies). torch's own CPU copy is avoided on purpose: it fans
  out over torch's intra-op threads and, measured here, slows to a crawl next
  to a busy Python thread.
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


_RUN_SEARCH_ENTRIES = 32
"""Batches of at least this many entries look for strided runs (vectorized); smaller ones join
back-to-back entries on the fly while copying."""


def _strided(flat: np.ndarray, offset: int, count: int, size: int, step: int) -> np.ndarray:
    """A ``(count, size)`` view of ``flat`` starting at ``offset``, rows ``step`` bytes apart (bounds-checked)."""
    end = offset + (count - 1) * step + size
    view: np.ndarray = np.ndarray((count, size), dtype=np.uint8, buffer=flat[offset:end], strides=(step, 1))
    return view


class _HostSpaces:
    """The arrays of a batch's allocations and memoryviews of them, released by :meth:`release`."""

    def __init__(self, batch: CopyBatch) -> None:
        self.srcs: list[np.ndarray] = [space.view for space in batch.src_spaces]
        self.dsts: list[np.ndarray] = [space.view for space in batch.dst_spaces]
        self.smvs = [a.data for a in self.srcs]
        self.dmvs = [a.data for a in self.dsts]

    def copy(self, si: int, di: int, so: int, do: int, n: int) -> None:
        """``n`` contiguous bytes: under the GIL when small, else with ``np.copyto`` (which releases it)."""
        if n < _HOLD_GIL_BYTES:
            self.dmvs[di][do : do + n] = self.smvs[si][so : so + n]
        else:
            np.copyto(self.dsts[di][do : do + n], self.srcs[si][so : so + n], casting="no")

    def release(self) -> None:
        for view in (*self.smvs, *self.dmvs):
            view.release()


def _copy_entries(batch: CopyBatch, spaces: _HostSpaces) -> None:
    """One call per entry, joining entries that continue each other on both sides."""
    pending: list[int] = []  # si, di, so, do, n of the copy being extended
    for entry in zip(
        batch.src_index.tolist(),
        batch.dst_index.tolist(),
        batch.src_offsets.tolist(),
        batch.dst_offsets.tolist(),
        batch.sizes.tolist(),
        strict=True,
    ):
        if (
            pending
            and entry[0] == pending[0]
            and entry[1] == pending[1]
            and entry[2] == pending[2] + pending[4]
            and entry[3] == pending[3] + pending[4]
        ):
            pending[4] += entry[4]
            continue
        if pending:
            spaces.copy(*pending)
        pending = list(entry)
    if pending:
        spaces.copy(*pending)


def _copy_runs(batch: CopyBatch, spaces: _HostSpaces) -> None:
    """One call per strided run (see :meth:`CopyBatch.runs`)."""
    runs = batch.runs()
    for si, di, so, do, size, count, ss, ds in zip(
        runs.src_index.tolist(),
        runs.dst_index.tolist(),
        runs.src_offsets.tolist(),
        runs.dst_offsets.tolist(),
        runs.sizes.tolist(),
        runs.counts.tolist(),
        runs.src_steps.tolist(),
        runs.dst_steps.tolist(),
        strict=True,
    ):
        if count == 1 or (ss == size and ds == size):
            spaces.copy(si, di, so, do, size * count)
        else:
            src, dst = spaces.srcs[si], spaces.dsts[di]
            np.copyto(_strided(dst, do, count, size, ds), _strided(src, so, count, size, ss), casting="no")


def copy_host_batch(batch: CopyBatch) -> None:
    """Copy every entry of a host-to-host batch on the calling thread (see the module docstring)."""
    spaces = _HostSpaces(batch)
    try:
        if batch.sizes.size < _RUN_SEARCH_ENTRIES:
            _copy_entries(batch, spaces)
        else:
            _copy_runs(batch, spaces)
    finally:
        spaces.release()


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
