"""Offline reference hit rates for a block trace: unbounded, LRU and Belady.

All three use the *prefix-hit* rule that an engine sees: a block reference of a
request counts as a hit only if it and every earlier block of that request are
in the cache. Blocks after the first miss are recomputed and stored again (a
no-op when still present).

* :func:`unbounded_hit_rate` - a cache that never evicts (the ceiling for any
  policy and any capacity).
* :func:`lru_hit_rate` - a plain LRU of ``capacity`` blocks (a cross-check of
  the real manager's replay).
* :func:`belady_hit_rate` - Belady's offline optimum: on a miss with a full
  cache, evict the block whose next use lies farthest in the future; the new
  block is itself a candidate (it is not admitted when its own next use is the
  farthest), which is the optimal (MIN with bypass) variant. O(n log n) with a
  lazily cleaned max-heap keyed by next use.

Pure functions over a :class:`~kvtier.workload.trace.FlatTrace`; any thread.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from kvtier.errors import ConfigError
from kvtier.workload.trace import FlatTrace


@dataclass
class HitRateResult:
    """Prefix hits of one replay. ``tier_hits`` splits ``hits`` by tier where known."""

    name: str
    capacity: int | None
    refs: int
    hits: int
    seconds: float = 0.0
    tier_hits: dict[str, int] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.refs if self.refs else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "capacity_blocks": self.capacity,
            "block_refs": self.refs,
            "prefix_hits": self.hits,
            "hit_rate": self.hit_rate,
            "tier_hits": dict(self.tier_hits),
            "tier_hit_rates": {t: h / self.refs if self.refs else 0.0 for t, h in self.tier_hits.items()},
            "seconds": self.seconds,
            **{k: v if math.isfinite(v) else None for k, v in self.extra.items()},  # JSON has no infinity
        }


def _check_capacity(capacity: int) -> None:
    if capacity <= 0:
        raise ConfigError(f"capacity must be a positive number of blocks, got {capacity}")


def unbounded_hit_rate(trace: FlatTrace) -> HitRateResult:
    """Prefix-hit rate of a cache that keeps every block forever."""
    start = time.perf_counter()
    ids = trace.ids.tolist()
    starts = trace.starts.tolist()
    seen: set[int] = set()
    hits = 0
    for r in range(len(starts) - 1):
        s, e = starts[r], starts[r + 1]
        pos = s
        while pos < e and ids[pos] in seen:
            pos += 1
        hits += pos - s
        seen.update(ids[pos:e])
    return HitRateResult("unbounded", None, len(ids), hits, time.perf_counter() - start)


def lru_hit_rate(trace: FlatTrace, capacity: int) -> HitRateResult:
    """Prefix-hit rate of a plain LRU cache of ``capacity`` blocks."""
    _check_capacity(capacity)
    start = time.perf_counter()
    ids = trace.ids.tolist()
    starts = trace.starts.tolist()
    cache: OrderedDict[int, None] = OrderedDict()
    move = cache.move_to_end
    hits = 0
    for r in range(len(starts) - 1):
        prefix = True
        for b in ids[starts[r] : starts[r + 1]]:
            if b in cache:
                hits += prefix
                move(b)
            else:
                prefix = False
                cache[b] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return HitRateResult("lru-sim", capacity, len(ids), hits, time.perf_counter() - start)


def next_use(ids: np.ndarray) -> np.ndarray:
    """``out[i]`` = the next position ``j > i`` with ``ids[j] == ids[i]``, else ``len(ids)``.

    Vectorized: a stable sort groups equal ids in position order.
    """
    n = len(ids)
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    out = np.full(n, n, dtype=np.int64)
    if n > 1:
        same = sorted_ids[1:] == sorted_ids[:-1]
        out[order[:-1][same]] = order[1:][same]
    return out


def belady_hit_rate(trace: FlatTrace, capacity: int, *, bypass: bool = True) -> HitRateResult:
    """Prefix-hit rate of Belady's offline optimum with ``capacity`` blocks.

    ``bypass=False`` gives classic MIN, which must admit every missed block.
    """
    _check_capacity(capacity)
    start = time.perf_counter()
    ids = trace.ids.tolist()
    starts = trace.starts.tolist()
    nxt = next_use(trace.ids).tolist()
    never = len(ids)
    cache: dict[int, int] = {}  # block -> position of its next use
    heap: list[tuple[int, int]] = []  # (-next_use, block); stale entries skipped lazily
    push, pop = heapq.heappush, heapq.heappop
    hits = 0
    for r in range(len(starts) - 1):
        prefix = True
        for pos in range(starts[r], starts[r + 1]):
            b = ids[pos]
            nu = nxt[pos]
            if b in cache:
                hits += prefix
                cache[b] = nu
                push(heap, (-nu, b))
                continue
            prefix = False
            if len(cache) < capacity:
                cache[b] = nu
                push(heap, (-nu, b))
                continue
            if bypass and nu == never:
                continue
            while True:
                neg, victim = heap[0]
                if cache.get(victim) == -neg:
                    break
                pop(heap)
            if bypass and -neg <= nu:
                continue
            pop(heap)
            del cache[victim]
            cache[b] = nu
            push(heap, (-nu, b))
        if len(heap) > 4 * (capacity + 1024):
            heap = [(-v, k) for k, v in cache.items()]
            heapq.heapify(heap)
    name = "belady" if bypass else "belady-min"
    return HitRateResult(name, capacity, len(ids), hits, time.perf_counter() - start)
