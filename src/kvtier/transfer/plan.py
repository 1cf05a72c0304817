"""Copy plans: every byte range one device <-> CPU copy job moves, held as arrays.

A copy job (a store of some device blocks into CPU rows, or a load back) is
described once, on the thread that submits it, as a :class:`CopyPlan`: per pair
of allocations (:class:`ByteSpace`), the source offsets, destination offsets and
sizes of its copies (:class:`CopyBatch`). Builders compute those arrays with
numpy from block ids and per-layer strides, so a job of 64 blocks x 48 layers
costs a few numpy calls, not 3,000 Python-level slices. A backend
(:mod:`kvtier.transfer.backends`, or vLLM's batched swap op in the vLLM
integration) then executes the whole plan.

Safety: a backend may copy by raw address, so every offset is checked against
the extent of its allocation when a batch is built (:class:`CopyBatch`), and
the plan keeps every allocation alive until it is dropped.

Everything here is plain data plus pure functions: no threads, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvtier.errors import KvtierError

PAGE_BYTES = 4096

_MIN_RUN_ENTRIES = 3
"""Entries a strided run must span before it replaces single copies (two save too little)."""

_INT64 = np.int64


def _is_torch(buf: Any) -> bool:
    return not isinstance(buf, np.ndarray) and hasattr(buf, "untyped_storage")


def _extent(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> int:
    """Bytes spanned from the first to past the last element of a strided view (0 if empty)."""
    if any(n == 0 for n in shape):
        return 0
    if any(s < 0 for s in strides):
        raise KvtierError(f"copy buffers with negative strides are not supported (strides {tuple(strides)})")
    return sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + itemsize


@dataclass(frozen=True, eq=False)
class ByteSpace:
    """One allocation seen as flat bytes.

    ``view`` is a 1-D uint8 view of the whole allocation: a numpy array for host
    memory, a torch tensor for device memory. ``address`` is the address of its
    first byte; ``device`` is ``"cpu"`` or a torch device string (``"cuda:0"``).
    Holding a ByteSpace keeps the allocation alive.
    """

    view: Any
    address: int
    nbytes: int
    device: str

    @property
    def on_host(self) -> bool:
        return self.device == "cpu"


def _numpy_space(buf: np.ndarray) -> tuple[ByteSpace, int]:
    root = buf
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not root.flags.c_contiguous:
        root = buf
    if not root.flags.c_contiguous:
        raise KvtierError(
            f"a copy buffer of shape {buf.shape} and strides {buf.strides} is neither contiguous nor a view of a "
            "contiguous array; pass a view of one allocation"
        )
    flat = root.reshape(-1).view(np.uint8)
    space = ByteSpace(flat, int(flat.ctypes.data), int(flat.nbytes), "cpu")
    return space, int(buf.ctypes.data) - space.address


def _torch_space(buf: Any) -> tuple[ByteSpace, int]:
    import torch

    storage = buf.untyped_storage()
    nbytes = int(storage.nbytes())
    flat = torch.empty(0, dtype=torch.uint8, device=buf.device).set_(storage, 0, (nbytes,), (1,))
    device = str(buf.device)
    view = flat.numpy() if device == "cpu" else flat
    address = int(storage.data_ptr())
    return ByteSpace(view, address, nbytes, device), int(buf.data_ptr()) - address


def byte_space(buf: Any) -> tuple[ByteSpace, int]:
    """The allocation ``buf`` (a numpy array or torch tensor) views, and ``buf``'s byte offset in it.

    Torch tensors map to their whole storage (so views of one allocation, such
    as the per-layer views of a layer-major KV cache, share one space); numpy
    arrays to the outermost contiguous array they view. Raises
    :class:`KvtierError` if ``buf`` does not lie inside that space.
    """
    if isinstance(buf, np.ndarray):
        space, offset = _numpy_space(buf)
        extent = _extent(buf.shape, buf.strides, buf.itemsize)
    elif _is_torch(buf):
        space, offset = _torch_space(buf)
        size = buf.element_size()
        extent = _extent(tuple(buf.shape), tuple(s * size for s in buf.stride()), size)
    else:
        raise KvtierError(f"copy buffers must be numpy arrays or torch tensors, got {type(buf).__name__}")
    if offset < 0 or offset + extent > space.nbytes:
        raise KvtierError(f"buffer at offset {offset} (+{extent} bytes) lies outside its allocation of {space.nbytes}")
    return space, offset


def _as_offsets(values: Any, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.size and arr.dtype.kind not in "iu":
        raise KvtierError(f"{what} must be integers, got dtype {arr.dtype}")
    return arr.astype(_INT64, copy=False)


class StridedRuns(NamedTuple):
    """A batch's copies grouped into strided runs, in entry order.

    Run ``r`` copies ``counts[r]`` pieces of ``sizes[r]`` bytes from source
    space ``src_index[r]`` to destination space ``dst_index[r]``: piece ``j``
    from ``src_offsets[r] + j * src_steps[r]`` to ``dst_offsets[r] + j *
    dst_steps[r]``. Steps are 0 for a single piece; a run whose steps equal its
    size on both sides is one contiguous copy of ``counts * sizes`` bytes.
    """

    src_index: np.ndarray
    dst_index: np.ndarray
    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    sizes: np.ndarray
    counts: np.ndarray
    src_steps: np.ndarray
    dst_steps: np.ndarray


@dataclass(frozen=True, eq=False)
class CopyBatch:
    """Copies between allocations: entry ``i`` moves ``sizes[i]`` bytes.

    From ``src_spaces[src_index[i]]`` at ``src_offsets[i]`` to
    ``dst_spaces[dst_index[i]]`` at ``dst_offsets[i]``; one batch can span any
    number of allocations (a job over 64 per-layer tensors is one batch). All
    arrays are 1-D int64 of one length. Build with :meth:`create`, which checks
    every entry lies inside its allocations; the plain constructor trusts its
    caller (:class:`~kvtier.transfer.layout.BlockMapping`, whose ids and layouts
    are checked). Entries must not overlap on the destination side (they are
    copied in an unspecified order).
    """

    src_spaces: tuple[ByteSpace, ...]
    dst_spaces: tuple[ByteSpace, ...]
    src_index: np.ndarray
    dst_index: np.ndarray
    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    sizes: np.ndarray

    @classmethod
    def create(
        cls,
        src: ByteSpace | Sequence[ByteSpace],
        dst: ByteSpace | Sequence[ByteSpace],
        src_offsets: Any,
        dst_offsets: Any,
        sizes: Any,
        *,
        src_index: Any = None,
        dst_index: Any = None,
    ) -> CopyBatch:
        """A checked batch. ``src``/``dst``: one space or several (then ``*_index`` picks one per entry).

        ``sizes`` may be one int for every entry. Raises :class:`KvtierError`
        naming the problem: lengths differ, a size is negative, an index or an
        entry reaches outside its allocation.
        """
        src_spaces = (src,) if isinstance(src, ByteSpace) else tuple(src)
        dst_spaces = (dst,) if isinstance(dst, ByteSpace) else tuple(dst)
        so = _as_offsets(src_offsets, "source offsets")
        do = _as_offsets(dst_offsets, "destination offsets")
        sz = (
            np.full(so.shape, int(sizes), _INT64)
            if isinstance(sizes, (int, np.integer))
            else _as_offsets(sizes, "sizes")
        )
        si = np.zeros(so.shape, _INT64) if src_index is None else _as_offsets(src_index, "source space indexes")
        di = np.zeros(so.shape, _INT64) if dst_index is None else _as_offsets(dst_index, "destination space indexes")
        if not (so.shape == do.shape == sz.shape == si.shape == di.shape):
            raise KvtierError(
                f"copy batch lengths differ: {so.size} source offsets, {do.size} destination offsets, "
                f"{sz.size} sizes, {si.size} source and {di.size} destination space indexes"
            )
        if so.size:
            if int(sz.min()) < 0:
                raise KvtierError(f"copy sizes must be >= 0, got {int(sz.min())}")
            for name, spaces, index, offsets in (("source", src_spaces, si, so), ("destination", dst_spaces, di, do)):
                if int(index.min()) < 0 or int(index.max()) >= len(spaces):
                    raise KvtierError(f"copy {name} space index out of range: {len(spaces)} spaces given")
                ends = offsets + sz
                limits = np.asarray([space.nbytes for space in spaces], _INT64)[index]
                bad = np.flatnonzero((offsets < 0) | (ends > limits))
                if bad.size:
                    k = int(bad[0])
                    space = spaces[int(index[k])]
                    raise KvtierError(
                        f"copy {name} range [{int(offsets[k])}, {int(ends[k])}) lies outside its allocation of "
                        f"{space.nbytes} bytes ({space.device})"
                    )
        return cls(src_spaces, dst_spaces, si, di, so, do, sz)

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())

    @property
    def num_copies(self) -> int:
        return int(self.sizes.size)

    def merged(self) -> CopyBatch:
        """The same copies with each run of back-to-back entries (contiguous on both sides) joined into one."""
        so, do, sz = self.src_offsets, self.dst_offsets, self.sizes
        if so.size < 2:
            return self
        si, di = self.src_index, self.dst_index
        joins = (
            (so[:-1] + sz[:-1] == so[1:]) & (do[:-1] + sz[:-1] == do[1:]) & (si[:-1] == si[1:]) & (di[:-1] == di[1:])
        )
        if not joins.any():
            return self
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        return CopyBatch(
            self.src_spaces,
            self.dst_spaces,
            si[starts],
            di[starts],
            so[starts],
            do[starts],
            np.add.reduceat(sz, starts),
        )

    def runs(self) -> StridedRuns:
        """The copies as strided runs (see :class:`StridedRuns`), found with a few vectorized passes.

        A run is a stretch of at least three entries of one size, within one pair
        of allocations, whose source and destination offsets each advance by a
        constant step no smaller than the size (so its pieces never overlap):
        the per-layer pages of one block in a layer-major cache, one layer of
        consecutive blocks, or back-to-back pieces. Runs are searched in entry
        order only; a backend copies each run with one call.
        """
        si, di = self.src_index, self.dst_index
        so, do, sz = self.src_offsets, self.dst_offsets, self.sizes
        n = so.size
        zeros = np.zeros(n, _INT64)
        if n < _MIN_RUN_ENTRIES:
            return StridedRuns(si, di, so, do, sz, np.ones(n, _INT64), zeros, zeros)
        ds, dd = so[1:] - so[:-1], do[1:] - do[:-1]
        # link k joins entry k to entry k+1
        ok = (sz[1:] == sz[:-1]) & (ds >= sz[:-1]) & (dd >= sz[:-1]) & (sz[:-1] > 0)
        ok &= (si[1:] == si[:-1]) & (di[1:] == di[:-1])
        same = np.zeros(n - 1, dtype=bool)
        same[1:] = ok[1:] & ok[:-1] & (ds[1:] == ds[:-1]) & (dd[1:] == dd[:-1])
        if not same.any():
            return StridedRuns(si, di, so, do, sz, np.ones(n, _INT64), zeros, zeros)
        segment = np.cumsum(~same)  # links of one constant-step stretch share an id
        length = np.bincount(segment)[segment]
        member = ok & (length >= _MIN_RUN_ENTRIES - 1)
        # A stretch that starts where a kept one ends gives up its first link (the shared entry).
        first = np.ones(n - 1, dtype=bool)
        first[1:] = ~same[1:]
        prev_member = np.zeros(n - 1, dtype=bool)
        prev_member[1:] = member[:-1]
        member &= ~(first & prev_member)
        # Entry e continues a run if link e-1 is a member; otherwise it starts a run.
        continues = np.zeros(n, dtype=bool)
        continues[1:] = member
        starts = np.flatnonzero(~continues)
        counts = (np.append(starts[1:], n) - starts).astype(_INT64)
        multi = counts > 1
        link = np.minimum(starts, n - 2)
        src_steps = np.where(multi, ds[link], 0).astype(_INT64)
        dst_steps = np.where(multi, dd[link], 0).astype(_INT64)
        return StridedRuns(si[starts], di[starts], so[starts], do[starts], sz[starts], counts, src_steps, dst_steps)

    def pointer_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(src_addresses, dst_addresses, sizes)`` of every copy, int64, back-to-back copies joined."""
        batch = self.merged()
        src_base = np.asarray([s.address for s in self.src_spaces], _INT64)
        dst_base = np.asarray([s.address for s in self.dst_spaces], _INT64)
        return (
            batch.src_offsets + src_base[batch.src_index],
            batch.dst_offsets + dst_base[batch.dst_index],
            batch.sizes.copy(),
        )


class CopyPlan:
    """Every copy of one job, as batches (usually one: a batch may span many allocations).

    ``nbytes`` is the total moved. Build with :meth:`of`, :meth:`from_pairs` or
    a layout-aware builder (:meth:`kvtier.transfer.layout.BlockMapping.plan`,
    whose plans build their batches only when asked: the host backend copies
    them straight from block ids). A plan is not changed once built.
    """

    __slots__ = ("_batches", "nbytes")

    def __init__(self, batches: tuple[CopyBatch, ...], nbytes: int) -> None:
        self._batches: tuple[CopyBatch, ...] | None = tuple(batches)
        self.nbytes = nbytes

    @property
    def batches(self) -> tuple[CopyBatch, ...]:
        """The copies as batches of offset arrays (what device backends and ``pointer_arrays`` read)."""
        assert self._batches is not None
        return self._batches

    @classmethod
    def of(cls, batches: Sequence[CopyBatch]) -> CopyPlan:
        """A plan of ``batches``; empty ones are dropped."""
        kept = tuple(b for b in batches if b.sizes.size)
        return cls(kept, sum(b.nbytes for b in kept))

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[Any, Any]]) -> CopyPlan:
        """A plan from ``(dst, src)`` buffer pairs of equal byte size (numpy arrays or torch tensors).

        Each buffer must be contiguous. Raises :class:`KvtierError` on a size
        mismatch or a non-contiguous buffer.
        """
        spaces: dict[str, dict[tuple[int, int, str], int]] = {"src": {}, "dst": {}}
        found: dict[str, list[ByteSpace]] = {"src": [], "dst": []}
        columns: list[list[int]] = [[], [], [], [], []]  # src index, dst index, src offset, dst offset, size

        def index(side: str, space: ByteSpace) -> int:
            key = (space.address, space.nbytes, space.device)
            known = spaces[side]
            if key not in known:
                known[key] = len(found[side])
                found[side].append(space)
            return known[key]

        for dst, src in pairs:
            n = _contiguous_nbytes(dst)
            m = _contiguous_nbytes(src)
            if n != m:
                raise KvtierError(f"copy size mismatch: dst has {n} bytes, src has {m}")
            dspace, doff = byte_space(dst)
            sspace, soff = byte_space(src)
            for column, value in zip(columns, (index("src", sspace), index("dst", dspace), soff, doff, n), strict=True):
                column.append(value)
        if not columns[0]:
            return cls((), 0)
        si, di, so, do, sz = (np.asarray(c, _INT64) for c in columns)
        return cls.of([CopyBatch(tuple(found["src"]), tuple(found["dst"]), si, di, so, do, sz)])

    @property
    def num_copies(self) -> int:
        return sum(int(b.sizes.size) for b in self.batches)

    @property
    def device(self) -> str:
        """``"cpu"`` when every allocation is host memory, else the first device involved."""
        for batch in self.batches:
            for space in (*batch.src_spaces, *batch.dst_spaces):
                if not space.on_host:
                    return space.device
        return "cpu"

    @property
    def on_host(self) -> bool:
        return self.device == "cpu"

    def pointer_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(src_addresses, dst_addresses, sizes)`` of every copy, int64, for a batched copy op."""
        if not self.batches:
            empty = np.zeros(0, _INT64)
            return empty, empty, empty
        parts = [b.pointer_arrays() for b in self.batches]
        if len(parts) == 1:
            return parts[0]
        src, dst, sizes = zip(*parts, strict=True)
        return np.concatenate(src), np.concatenate(dst), np.concatenate(sizes)


def _contiguous_nbytes(buf: Any) -> int:
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise KvtierError(f"copy buffer of shape {buf.shape} is not contiguous; pass contiguous block views")
        return int(buf.nbytes)
    if _is_torch(buf):
        if not buf.is_contiguous():
            raise KvtierError(f"copy tensor of shape {tuple(buf.shape)} is not contiguous; pass contiguous block views")
        return int(buf.numel() * buf.element_size())
    raise KvtierError(f"copy buffers must be numpy arrays or torch tensors, got {type(buf).__name__}")


def aligned_host_array(shape: int | tuple[int, ...], align: int = PAGE_BYTES) -> np.ndarray:
    """A zeroed, resident uint8 array whose first byte is ``align``-aligned (default: a page).

    Stands in for an engine's device pool (``kvtier bench``, benchmarks, tests),
    which is allocated and resident before any copy. numpy's own allocations
    start 16 bytes into a page, and copies between such a buffer and
    page-aligned CPU rows run up to 1.8x slower than between equally aligned
    buffers (measured on this project's VMs); and ``np.zeros`` maps pages lazily,
    so a first copy into them pays the page faults (about 1 GB/s). Here every
    page is written once up front.
    """
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(dims, dtype=np.int64))
    raw = np.empty(nbytes + align, dtype=np.uint8)
    raw.fill(0)
    start = (-int(raw.ctypes.data)) % align
    return raw[start : start + nbytes].reshape(dims)
