"""One request through a manager as an engine drives it, for tests that replay workloads."""

from __future__ import annotations

import time

from kvtier import RequestContext, TieringManager


def serve(mgr: TieringManager, request: RequestContext, keys: list[bytes]) -> int:
    """Look ``keys`` up in prefix order (stepping the manager on RETRY), load the hits, store the
    rest, end the request and its step, then step until every tier job was reported. Returns the
    prefix hits."""
    mgr.on_new_request(request)
    hits = 0
    while hits < len(keys):
        answer = mgr.lookup(keys[hits], request).value
        if answer == "retry":
            mgr.on_schedule_end()
            continue
        if answer != "hit":
            break
        hits += 1
    if hits:
        mgr.prepare_load(keys[:hits], request)
        mgr.complete_load(keys[:hits], request)
    result = mgr.prepare_store(keys[hits:], request)
    if result is not None and result.keys_to_store:
        mgr.complete_store(result.keys_to_store, request)
    mgr.on_request_finished(request)
    mgr.on_schedule_end()
    while mgr.has_pending_work():
        time.sleep(0.0002)
        mgr.on_schedule_end()
    return hits


def settle(mgr: TieringManager, limit: float = 30.0) -> None:
    """End the step, then step until every tier job was reported (fails past ``limit`` seconds)."""
    mgr.on_schedule_end()
    deadline = time.monotonic() + limit
    while mgr.has_pending_work():
        assert time.monotonic() < deadline, f"tier jobs still pending after {limit:g} s"
        time.sleep(0.001)
        mgr.on_schedule_end()


def store_new(mgr: TieringManager, keys: list[bytes], name: str) -> None:
    """A request ``name`` that stores every block of ``keys`` (none held yet), ends, and settles."""
    request = RequestContext(name)
    mgr.on_new_request(request)
    result = mgr.prepare_store(keys, request)
    assert result is not None and result.keys_to_store == keys
    mgr.complete_store(keys, request)
    mgr.on_request_finished(request)
    settle(mgr)
