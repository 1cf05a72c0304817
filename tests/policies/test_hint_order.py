"""An ended conversation's blocks go first whatever the order of its request's end and its last
store's completion, and whether or not its rows were pinned meanwhile (through TieringManager).

A CPU tier of 8 rows: request B (3 blocks, no hints), then request A (3 blocks, the last of its
conversation: ``kvtier_session_end``); request C needs 4 rows, so 2 blocks go: A's (its tail
first), never B's (what LRU would take).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier import KVGeometry, Namespace, RequestContext, TieringManager
from kvtier.keys import BlockKey
from request_flow import settle

NAMESPACE = Namespace("kvtier/test-hint-order", KVGeometry.from_block_bytes(64, tokens_per_block=4))
ENDED = {"kvtier_session": "a", "kvtier_session_end": True}


def _keys(tag: str, n: int) -> list[BlockKey]:
    out, digest = [], tag.encode()
    for _ in range(n):
        digest = hashlib.sha256(digest).digest()
        out.append(digest)
    return out


A, B, C = _keys("A", 3), _keys("B", 3), _keys("C", 4)


@pytest.fixture(params=[False, True], ids=["cpu-only", "cascade"])
def manager(request: pytest.FixtureRequest, private_shm: Path) -> Iterator[TieringManager]:
    """The CPU tier alone, or with a memory tier below it: each store's rows are pinned while the
    cascade reads them, and released when the tier reports it (unpinned: evictable again)."""
    tiers = [{"type": "memory"}] if request.param else []
    mgr = TieringManager.create(
        namespace=NAMESPACE, num_cpu_blocks=8, policy="return-time", tiers=tiers, shm_dir=str(private_shm),
        prefault=False,
    )  # fmt: skip
    yield mgr
    mgr.shutdown()


def _serve(mgr: TieringManager, name: str, keys: list[BlockKey], params: dict[str, Any], finish_first: bool) -> None:
    """A request that stores ``keys``; it finishes before its store completes if ``finish_first``
    (vLLM's order for a request's last store), after it otherwise."""
    request = RequestContext(name, params)
    mgr.on_new_request(request)
    result = mgr.prepare_store(keys, request)
    assert result is not None and result.keys_to_store == keys
    if finish_first:
        mgr.on_request_finished(request)
        mgr.complete_store(keys, request)
    else:
        mgr.complete_store(keys, request)
        mgr.on_request_finished(request)
    settle(mgr)


def _evicted_for_c(mgr: TieringManager) -> set[BlockKey]:
    request = RequestContext("C")
    mgr.on_new_request(request)
    result = mgr.prepare_store(C, request)
    assert result is not None and result.keys_to_store == C
    mgr.complete_store(C, request)
    mgr.on_request_finished(request)
    settle(mgr)
    return set(result.evicted_keys)


@pytest.mark.parametrize("finish_first", [False, True], ids=["complete-then-finish", "finish-then-complete"])
def test_an_ended_conversation_goes_first_in_either_order(manager: TieringManager, finish_first: bool) -> None:
    """Regression (review): with the request finished before its last store completed (or its rows
    pinned by a cascade when it finished), the blocks went to the expired list's tail when they
    became evictable, and B's went first, as under LRU; the hint still counted as applied."""
    _serve(manager, "B", B, {}, finish_first)
    _serve(manager, "A", A, ENDED, finish_first)
    assert manager.stats().cpu.policy.values["hinted_ended"] == 1
    assert _evicted_for_c(manager) == {A[2], A[1]}, "A's own blocks, tail first; none of B's"


def test_a_reference_after_the_end_keeps_the_blocks_held_again(manager: TieringManager) -> None:
    """A load of the ended conversation's blocks (it came back after all) ends their going first:
    the blocks referenced least recently go, B's."""
    _serve(manager, "B", B, {}, True)
    _serve(manager, "A", A, ENDED, True)
    again = RequestContext("A2")
    manager.on_new_request(again)
    assert manager.lookup_prefix(A, again).ready == len(A)
    manager.prepare_load(A, again)
    manager.complete_load(A, again)
    manager.on_request_finished(again)
    settle(manager)
    assert _evicted_for_c(manager) == {B[2], B[1]}
