"""Device <-> CPU copy GB/s through kvtier's copy path against one memcpy of the same bytes, same run.

    .venv/bin/python benchmarks/bench_transfer.py                  # host "device" pool (this VM)
    .venv/bin/python benchmarks/bench_transfer.py --device cuda --pin   # a GPU, region page-locked

For every block size (64 KiB, 512 KiB, 2 MiB) and job size (1, 4, 16, 64 blocks)
and both directions, each repetition picks random distinct device blocks and
CPU rows out of pools larger than the last-level cache, then times, interleaved:

* ``memcpy``: one copy of the job's total bytes between a contiguous range of
  the device pool and a contiguous range of the rows (``np.copyto``; on CUDA one
  ``Tensor.copy_``), the baseline;
* ``kvtier``: planning the job (:class:`~kvtier.transfer.BlockMapping`) and
  executing it with the backend kvtier uses there (host backend; on CUDA vLLM's
  batched swap op if this vLLM build has it, else one ``copy_`` per copy),
  synchronously on the calling thread;
* ``engine``: the same job through a :class:`~kvtier.transfer.TransferEngine`
  (submit, then wait: adds the hand-off to the copy thread; reported, no target);
* ``piece``: one ``np.copyto`` / ``Tensor.copy_`` per (block, layer) piece on
  views built before timing: kvtier's copy path before job plans (no target);
* ``vllm``: vLLM 0.32's own CPU offloading handler on the same tensors and rows,
  where it can run (CUDA only: vLLM's CPU worker accepts CUDA/XPU tensors only).

Layouts: ``block`` keeps a block's bytes contiguous on the device (vLLM's
packed / block-major caches); ``layers`` splits each block over per-layer
tensors (``--layers``, default 32: a Llama-style cache of per-layer K/V pages),
so a job is ``blocks x layers`` copies, allocated one after the other as an engine does
(equally spaced in memory, which kvtier copies as one strided run per block);
``layers-scattered`` places the same tensors at irregular distances (kvtier's
fallback: one call per piece); ``layer-major`` is one tensor of
per-layer views. The printed ratio is median memcpy time
/ kvtier time, the median over repetitions (each repetition times both back to back, so a
burst of load from other processes hits both); target >= 0.90 (MET/MISSED) in both directions.
GB/s columns are bytes / median time of each method.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.region import SharedRegion
from kvtier.transfer import (
    BlockMapping,
    BlockPieces,
    CopyBackend,
    HostCopyBackend,
    TorchCopyBackend,
    TransferEngine,
    aligned_host_array,
)

TARGET = 0.90
KIB = 1024
LAYOUTS = ["block", "layers", "layers-scattered", "layer-major"]


@dataclass
class Cell:
    """Times of one (layout, block size, blocks per job, direction) cell."""

    nbytes: int
    times: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)

    def gbps(self, name: str) -> float | None:
        t = self.times.get(name)
        return self.nbytes / statistics.median(t) / 1e9 if t else None

    def ratio(self, name: str, baseline: str = "memcpy") -> float:
        """Median over repetitions of ``baseline`` time / ``name`` time, each pair timed back to back.

        Pairing keeps a burst of load from other processes, which slows both
        runs of one repetition, from tilting the ratio (a ratio of medians
        mixes repetitions measured under different load).
        """
        ours, base = self.times.get(name), self.times.get(baseline)
        if not ours or not base:
            return 0.0
        return statistics.median(b / t for b, t in zip(base, ours, strict=True))


class Side:
    """The device pool and the CPU rows of one layout, with the block mappings both ways.

    ``layout``: ``block`` (one ``(blocks, block_bytes)`` pool), ``layers`` (one
    ``(blocks, block_bytes / layers)`` allocation per layer, allocated one after
    the other as an engine does), ``layers-scattered`` (the same, at irregular
    distances from each other), ``layer-major``
    (one ``(layers, blocks, piece)`` allocation, per-layer views of it).
    """

    def __init__(self, args: argparse.Namespace, block_bytes: int, layout: str, region: SharedRegion) -> None:
        self.device = args.device
        self.block_bytes = block_bytes
        self.num_blocks = max(64, (args.pool_mib << 20) // block_bytes)
        self.num_rows = region.num_rows
        layers = 1 if layout == "block" else args.layers
        piece = block_bytes // layers
        nb = self.num_blocks
        if layout in ("layers", "layers-scattered"):
            # "layers-scattered" puts a spacer of random size between the tensors: no two layers are the
            # same distance apart, so kvtier cannot copy a block's layers as one strided run.
            spacers = np.random.default_rng(1).integers(1, 64, layers) * 4096 if layout == "layers-scattered" else None
            self.pool_tensors = []
            self._spacers = []
            for i in range(layers):
                self.pool_tensors.append(self._alloc((nb, piece)))
                if spacers is not None:
                    self._spacers.append(self._alloc((int(spacers[i]),)))
            self.pool_flat = self._alloc((nb * block_bytes,))  # the baseline's equally large contiguous pool
        else:
            pool = self._alloc((layers, nb, piece))
            self.pool_tensors = [pool[i] for i in range(layers)]
            self.pool_flat = pool.reshape(-1)
        self.rows = region.rows
        self.host_flat = self.rows.reshape(-1)
        self.row_stride = self.rows.shape[1]
        device_side = BlockPieces.from_block_views(self.pool_tensors)
        host_side = BlockPieces.from_rows(self.rows, [i * piece for i in range(layers)], [piece] * layers)
        self.to_host = BlockMapping(device_side, host_side)
        self.to_device = BlockMapping(host_side, device_side)

    def _alloc(self, shape: tuple[int, ...]) -> Any:
        if self.device == "cpu":
            arr = aligned_host_array(shape)
            arr[...] = np.random.default_rng(len(shape)).integers(0, 256, 4096, dtype=np.uint8)[0]
            return arr
        import torch

        t = torch.empty(shape, dtype=torch.int8, device=self.device)
        t.random_(-128, 127)
        return t

    def per_piece(self, to_device: bool, dev_ids: np.ndarray, rows: np.ndarray) -> Callable[[], None]:
        """One copy call per (block, layer) piece on prebuilt views: kvtier's copy path before job plans."""
        return self._runner([(d, h) if to_device else (h, d) for d, h in _pieces(self, dev_ids, rows)])

    def memcpy(self, to_device: bool, nbytes: int, rng: np.random.Generator) -> Callable[[], None]:
        """One contiguous copy of ``nbytes`` between random spots of the pool and the rows."""
        pool_at = int(rng.integers(0, self.pool_flat.shape[0] - nbytes + 1)) // 4096 * 4096
        host_at = int(rng.integers(0, self.num_rows - -(-nbytes // self.row_stride) + 1)) * self.row_stride
        dev = self.pool_flat[pool_at : pool_at + nbytes]
        host = self._host_view(self.host_flat[host_at : host_at + nbytes])
        return self._runner([(dev, host) if to_device else (host, dev)])

    def _host_view(self, host: np.ndarray) -> Any:
        if self.device == "cpu":
            return host
        import torch

        return torch.from_numpy(host).view(torch.int8)

    def _runner(self, pairs: list[tuple[Any, Any]]) -> Callable[[], None]:
        """Copy every ``(dst, src)`` pair, one call each (``np.copyto``; on a GPU ``copy_``, then a sync)."""
        if self.device == "cpu":

            def run_host() -> None:
                for dst, src in pairs:
                    np.copyto(dst, src)

            return run_host
        import torch

        def run_device() -> None:
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            torch.cuda.current_stream().synchronize()

        return run_device


def _pieces(side: Side, dev_ids: np.ndarray, rows: np.ndarray) -> list[tuple[Any, Any]]:
    """``(device piece, row piece)`` views of a job, built before timing."""
    piece = side.pool_tensors[0].shape[1]
    host = side._host_view(side.rows)
    return [
        (t[int(b)], host[int(r), i * piece : (i + 1) * piece])
        for b, r in zip(dev_ids, rows, strict=True)
        for i, t in enumerate(side.pool_tensors)
    ]


def _ids(
    rng: np.random.Generator, n: int, side: Side, to_device: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Random distinct ``(device blocks, rows)`` of a job, and the same as ``(source ids, destination ids)``."""
    dev_ids, rows = rng.choice(side.num_blocks, n, replace=False), rng.choice(side.num_rows, n, replace=False)
    return (dev_ids, rows, rows, dev_ids) if to_device else (dev_ids, rows, dev_ids, rows)


def _backend(device: str) -> tuple[CopyBackend, str]:
    if device == "cpu":
        return HostCopyBackend(), "host"
    try:
        from kvtier.integrations.vllm.swap import vllm_swap_backend

        swap = vllm_swap_backend()
    except ImportError:
        swap = None
    if swap is not None:
        return swap, swap.name
    return TorchCopyBackend(), "torch (vLLM's swap op not available)"


class VllmPath:
    """vLLM 0.32's own offloading handlers on the same tensors and rows (CUDA only)."""

    def __init__(self, side: Side, pinned: bool) -> None:
        import torch
        from vllm.v1.kv_offload.base import CanonicalKVCacheRef
        from vllm.v1.kv_offload.cpu.gpu_worker import SingleDirectionOffloadingHandler

        rows_t = torch.from_numpy(side.rows).view(torch.int8)
        piece = side.pool_tensors[0].shape[1]
        cpu_tensors = [rows_t[:, i * piece : (i + 1) * piece] for i in range(len(side.pool_tensors))]
        refs = [[CanonicalKVCacheRef(i, piece) for i in range(len(cpu_tensors))]]
        common = {"blocks_per_chunk": 1, "layer_refs_per_group": refs, "host_memory_is_pinned": pinned}
        self.store = SingleDirectionOffloadingHandler(list(side.pool_tensors), cpu_tensors, gpu_to_cpu=True, **common)
        self.load = SingleDirectionOffloadingHandler(list(side.pool_tensors), cpu_tensors, gpu_to_cpu=False, **common)
        self.job = 0

    def run(self, to_device: bool, dev_ids: np.ndarray, rows: np.ndarray) -> None:
        from vllm.v1.kv_offload.base import GPULoadStoreSpec
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        self.job += 1
        gpu = GPULoadStoreSpec(dev_ids.tolist(), [len(dev_ids)], [0])
        cpu = CPULoadStoreSpec(rows.tolist())
        handler = self.load if to_device else self.store
        ok = handler.transfer_async(self.job, cpu, gpu) if to_device else handler.transfer_async(self.job, gpu, cpu)
        assert ok, "vLLM's handler refused the transfer"
        handler.wait({self.job})
        handler.get_finished()


def measure(
    args: argparse.Namespace, region: SharedRegion, block_bytes: int, layout: str
) -> dict[tuple[int, bool], Cell]:
    side = Side(args, block_bytes, layout, region)
    backend, _ = _backend(args.device)
    engine = TransferEngine(device_backend=backend if args.device != "cpu" else None)
    vllm = None
    if args.device != "cpu" and not args.no_vllm:
        try:
            vllm = VllmPath(side, region.pinned)
        except Exception as exc:
            print(f"  (vLLM's own copy path not measured: {type(exc).__name__}: {exc})")
    sync: Callable[[], None] = lambda: None  # noqa: E731
    if args.device != "cpu":
        import torch

        def sync() -> None:
            torch.cuda.current_stream().synchronize()

    rng = np.random.default_rng(0)
    cells: dict[tuple[int, bool], Cell] = {}
    job_id = 0
    try:
        for n in args.jobs:
            reps = max(args.min_reps, min(args.max_reps, (args.budget_mib << 20) // (n * block_bytes)))
            for to_device in (False, True):
                cell = cells[(n, to_device)] = Cell(n * block_bytes)
                mapping = side.to_device if to_device else side.to_host
                for rep in range(reps + 1):  # the first round warms up and is dropped
                    # Every method gets its own random blocks: none finds another's bytes in the cache.
                    _, _, k_src, k_dst = _ids(rng, n, side, to_device)
                    _, _, e_src, e_dst = _ids(rng, n, side, to_device)
                    p_dev, p_rows, _, _ = _ids(rng, n, side, to_device)
                    v_dev, v_rows, _, _ = _ids(rng, n, side, to_device)

                    def kvtier(
                        src: np.ndarray = k_src, dst: np.ndarray = k_dst, mapping: BlockMapping = mapping
                    ) -> None:
                        keep = backend.run(mapping.plan(src, dst))
                        sync()
                        del keep

                    def via_engine(
                        src: np.ndarray = e_src, dst: np.ndarray = e_dst, mapping: BlockMapping = mapping
                    ) -> None:
                        nonlocal job_id
                        job_id += 1
                        engine.submit(job_id, mapping.plan(src, dst))
                        engine.wait([job_id], timeout=60)
                        (result,) = engine.poll()
                        assert result.success, result.error

                    runs: list[tuple[str, Callable[[], None]]] = [
                        ("memcpy", side.memcpy(to_device, n * block_bytes, rng)),
                        ("kvtier", kvtier),
                        ("engine", via_engine),
                        ("per-piece", side.per_piece(to_device, p_dev, p_rows)),
                    ]
                    if vllm is not None:
                        runs.append(("vllm", lambda d=v_dev, r=v_rows, t=to_device: vllm.run(t, d, r)))
                    if rep % 2:
                        runs.reverse()
                    for name, run in runs:
                        t0 = time.perf_counter()
                        run()
                        if rep:
                            cell.add(name, time.perf_counter() - t0)
    finally:
        engine.shutdown()
    return cells


def _fmt(x: float | None) -> str:
    return f"{x:7.2f}" if x is not None else "    n/a"


def report(title: str, cells_by_size: dict[int, dict[tuple[int, bool], Cell]]) -> list[bool]:
    print(f"\n{title}")
    print(
        f"{'block':>8} {'blocks':>6} {'direction':>12} {'memcpy':>7} {'kvtier':>7} {'engine':>7} "
        f"{'piece':>7} {'vllm':>7} {'kvtier/memcpy':>14} {'target':>7}"
    )
    verdicts: list[bool] = []
    for block_bytes, cells in cells_by_size.items():
        for (n, to_device), cell in cells.items():
            base, ours = cell.gbps("memcpy"), cell.gbps("kvtier")
            ratio = cell.ratio("kvtier")
            met = ratio >= TARGET
            verdicts.append(met)
            print(
                f"{block_bytes // KIB:>6}Ki {n:>6} {'CPU->device' if to_device else 'device->CPU':>12} "
                f"{_fmt(base)} {_fmt(ours)} {_fmt(cell.gbps('engine'))} {_fmt(cell.gbps('per-piece'))} "
                f"{_fmt(cell.gbps('vllm'))} "
                f"{ratio:>14.2f} {'MET' if met else 'MISSED':>7}"
            )
    return verdicts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (a host array stands in for the device) or cuda[:N]")
    parser.add_argument("--pin", action="store_true", help="page-lock the region (cudaHostRegister); CUDA only")
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 4, 16, 64], help="blocks per job")
    parser.add_argument(
        "--layouts", nargs="+", default=LAYOUTS, choices=LAYOUTS, help="device pool layouts (default: all)"
    )
    parser.add_argument("--layers", type=int, default=32, help="per-layer tensors of the 'layers' layout")
    parser.add_argument("--pool-mib", type=int, default=256, help="device pool and CPU rows, each (default 256)")
    parser.add_argument("--budget-mib", type=int, default=256, help="bytes per cell and method (sets repetitions)")
    parser.add_argument("--min-reps", type=int, default=9)
    parser.add_argument("--max-reps", type=int, default=400)
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's own copy path")
    parser.add_argument("--shm-dir", default="/dev/shm")
    args = parser.parse_args()
    if args.device != "cpu":
        import torch

        if not torch.cuda.is_available():
            print(f"--device {args.device}: CUDA is not available on this machine", file=sys.stderr)
            return 2
    elif args.pin:
        print("--pin needs a CUDA device (--device cuda)", file=sys.stderr)
        return 2
    if max(args.jobs) * max(args.sizes_kib) * KIB > (args.pool_mib << 20) // 2:
        print("--pool-mib must be at least twice the largest job", file=sys.stderr)
        return 2
    _, backend_name = _backend(args.device)
    print(
        f"device {args.device}, kvtier backend: {backend_name}, region "
        f"{'pinned' if args.pin else 'not pinned'}, pools of {args.pool_mib} MiB, GB/s = bytes / median time"
    )
    verdicts: list[bool] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-transfer-", dir=args.shm_dir) as shm:
        for layout in args.layouts:
            layers = 1 if layout == "block" else args.layers
            by_size: dict[int, dict[tuple[int, bool], Cell]] = {}
            for kib in args.sizes_kib:
                block_bytes = kib * KIB
                if block_bytes % (layers * 64):
                    print(f"  skipping {kib} KiB blocks: not divisible into {layers} layers of 64-byte multiples")
                    continue
                num_rows = max(64, (args.pool_mib << 20) // block_bytes)
                region = SharedRegion(f"bench-transfer-{kib}", num_rows, block_bytes, shm_dir=Path(shm), pin=args.pin)
                if args.pin and not region.pinned:
                    print("  warning: cudaHostRegister failed; the region is not pinned")
                try:
                    by_size[block_bytes] = measure(args, region, block_bytes, layout)
                finally:
                    region.close()
            title = {
                "block": "layout: block (each block contiguous on the device)",
                "layers": f"layout: layers ({layers} per-layer tensors; a job is blocks x {layers} copies)",
                "layers-scattered": f"layout: layers-scattered ({layers} per-layer tensors at irregular distances)",
                "layer-major": f"layout: layer-major (one tensor, {layers} per-layer views; strided runs)",
            }[layout]
            verdicts += report(title, by_size)
    met = sum(verdicts)
    print(f"\n{met} of {len(verdicts)} cells MET the target kvtier >= {TARGET:.2f} x memcpy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
