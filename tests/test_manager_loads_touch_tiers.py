"""A block the CPU tier serves keeps its place in the tiers behind it.

vLLM's connector never calls ``touch``, so before this the secondary tiers heard only of their own
writes and reads: a block the CPU tier kept and served aged in the fs tier as if unused, was
evicted there first, and was gone from both tiers once the CPU tier let it go (on the
conversation trace, CPU tier 1 % and fs tier 10 %, return-time's total hit rate fell to 0.988x
LRU's). ``prepare_load`` now touches the secondary tiers with the keys it loads.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier import LookupResult, Namespace, RequestContext, TieringManager, prefix_keys
from kvtier.keys import KVGeometry
from kvtier.tiers.fs import FilesystemTier
from kvtier.tiers.memory import MemoryTier
from request_flow import settle, store_new

pytestmark = pytest.mark.usefixtures("shm_leak_check")

NS = Namespace("loads-touch-test", KVGeometry.from_block_bytes(64, tokens_per_block=16))
TIER_BLOCKS = 8


def _spec(kind: str, tmp_path: Path) -> dict[str, object]:
    if kind == "fs":
        return {"type": "fs", "root": str(tmp_path / "fs"), "scan_in_background": False,
                "max_bytes": TIER_BLOCKS * FilesystemTier.bytes_per_block(64)}  # fmt: skip
    return {"type": "memory", "max_bytes": TIER_BLOCKS * MemoryTier.bytes_per_block(64)}


def _run(kind: str, tmp_path: Path, load: bool) -> tuple[bool, int]:
    """Store a block, then 3x the tier's capacity of other blocks, each followed (if ``load``) by a
    load of the first from the CPU tier (which holds every block). Returns whether the secondary
    tier still holds the first block, and how many of the others it holds."""
    rng = np.random.default_rng(11)
    blocks = [prefix_keys(rng.integers(0, 2**31, 1), 1) for _ in range(3 * TIER_BLOCKS + 1)]
    mgr = TieringManager.create(namespace=NS, num_cpu_blocks=64, policy="lru", tiers=[_spec(kind, tmp_path)])
    try:
        first = blocks[0]
        store_new(mgr, first, "first")
        for n, keys in enumerate(blocks[1:]):
            store_new(mgr, keys, f"other-{n}")
            if load:
                request = RequestContext(f"load-{n}")
                mgr.on_new_request(request)
                assert mgr.lookup(first[0], request) is LookupResult.HIT  # the CPU tier serves it
                mgr.prepare_load(first, request)
                mgr.complete_load(first, request)
                mgr.on_request_finished(request)
                settle(mgr)
        tier = mgr.tiers[0]
        return tier.holds(first[0]), sum(tier.holds(keys[0]) for keys in blocks[1:])
    finally:
        mgr.shutdown()


@pytest.mark.parametrize("kind", ["fs", "memory"])
def test_a_block_the_cpu_tier_serves_stays_in_the_tier_behind(kind: str, tmp_path: Path) -> None:
    kept, others = _run(kind, tmp_path / "loaded", load=True)
    assert kept, f"the {kind} tier evicted a block the CPU tier served after every store"
    assert others < 3 * TIER_BLOCKS, f"the {kind} tier evicted nothing: no pressure was tested"
    # The same run without the loads: the first block is the oldest and goes first.
    unused, _ = _run(kind, tmp_path / "unused", load=False)
    assert not unused, f"the {kind} tier kept an unused block through 3x its capacity of writes"


def test_a_request_touches_only_the_tiers_it_may_load_from(tmp_path: Path) -> None:
    """A request whose ``kvtier_load_tiers`` keeps it off a tier sends that tier none of its keys,
    by a load or by the engine's touch; the tier it may use still hears of both."""
    specs = [_spec("memory", tmp_path), _spec("memory", tmp_path)]
    mgr = TieringManager.create(namespace=NS, num_cpu_blocks=8, policy="lru", tiers=specs)
    seen: list[list[list[bytes]]] = [[], []]
    for tier, log in zip(mgr.tiers, seen, strict=True):
        tier.touch = lambda keys, request, log=log: log.append(list(keys))  # type: ignore[method-assign]
    try:
        keys = prefix_keys(np.arange(3), 1)
        store_new(mgr, keys, "stored")
        request = RequestContext("cpu-and-first", {"kvtier_load_tiers": ["cpu", "1:memory"]})
        mgr.prepare_load(keys, request)
        mgr.complete_load(keys, request)
        mgr.touch(keys[:1], request)
        assert seen == [[keys, keys[:1]], []]
        mgr.prepare_load(keys, RequestContext("any"))  # no control: every tier
        assert seen == [[keys, keys[:1], keys], [keys]]
    finally:
        mgr.shutdown()


def test_a_tier_whose_touch_raises_does_not_fail_the_load(tmp_path: Path) -> None:
    class Raising(MemoryTier):
        def touch(self, keys: object, request: RequestContext | None) -> None:
            raise RuntimeError("touch exploded")

    mgr = TieringManager.create(namespace=NS, num_cpu_blocks=8, policy="lru", tiers=[_spec("memory", tmp_path)])
    try:
        mgr.tiers[0].__class__ = Raising  # the same tier, its touch now raising
        keys = prefix_keys(np.arange(3), 1)
        store_new(mgr, keys, "r")
        request = RequestContext("load")
        rows = mgr.prepare_load(keys, request)
        assert len(rows) == 3
        mgr.complete_load(keys, request)
        assert mgr.stats().as_dict()["manager"]["tier_call_errors"] >= 1
    finally:
        mgr.shutdown()
