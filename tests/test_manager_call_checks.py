"""The manager's scheduler calls refuse arguments of the wrong kind with a TypeError that names the
call and the argument (review r1: they raised AttributeError, a misleading InvalidKeyError, a bare
"not iterable", or took success="False" as a success)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvtier import LookupResult, Namespace, RequestContext, TieringManager

pytestmark = pytest.mark.usefixtures("shm_leak_check")
KEY = b"k" * 32


@pytest.fixture
def mgr(namespace: Namespace) -> Iterator[TieringManager]:
    manager = TieringManager.create(namespace=namespace, num_cpu_blocks=8)
    yield manager
    manager.shutdown()


CALLS: list[tuple[str, Callable[[TieringManager], Any], str]] = [
    ("prepare_store, request a str", lambda m: m.prepare_store([KEY], "req"), "prepare_store: request must be"),
    ("complete_store, request a str", lambda m: m.complete_store([KEY], "req"), "complete_store: request must be"),
    ("on_request_finished(None)", lambda m: m.on_request_finished(None), "on_request_finished: request must be"),
    ("on_request_finished, a str", lambda m: m.on_request_finished("req"), "on_request_finished: request must be"),
    ("prepare_store of one key", lambda m: m.prepare_store(KEY), r"prepare_store: keys must be a list.*\[key\]"),
    ("prepare_store(None)", lambda m: m.prepare_store(None), "prepare_store: keys must be a list"),
    ("complete_store of a str", lambda m: m.complete_store("abc"), "complete_store: keys must be a list"),
    ("lookup_prefix(None)", lambda m: m.lookup_prefix(None), "lookup_prefix: keys must be a list"),
    ("lookup_prefix, request a str", lambda m: m.lookup_prefix([KEY], "req"), "lookup_prefix: request must be"),
    ("complete_store, success a str", lambda m: m.complete_store([KEY], None, "False"), "success must be True or"),
    ("complete_store, success 0", lambda m: m.complete_store([KEY], None, 0), "success must be True or False"),
    # Regression (review, 2026-12-05): "'int' object is not iterable", from deep in the call
    ("prepare_store(5)", lambda m: m.prepare_store(5), "prepare_store: keys must be a list"),
    ("complete_store(5.0)", lambda m: m.complete_store(5.0), "complete_store: keys must be a list"),
    ("lookup_prefix(7)", lambda m: m.lookup_prefix(7), "lookup_prefix: keys must be a list"),
]


@pytest.mark.parametrize(("what", "call", "message"), CALLS, ids=[c[0] for c in CALLS])
def test_a_wrong_argument_is_a_type_error_naming_it(mgr: TieringManager, what: str, call: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        call(mgr)


def test_a_store_whose_success_is_not_a_bool_stays_unwritten(mgr: TieringManager) -> None:
    """complete_store(success="False") (a string from a config, say) made the unwritten row a HIT:
    wrong bytes. It is refused, the row stays in flight, and a real failure then frees it."""
    req = RequestContext("r")
    result = mgr.prepare_store([KEY], req)
    assert result is not None
    with pytest.raises(TypeError):
        mgr.complete_store(result.keys_to_store, req, "False")  # type: ignore[arg-type]
    assert mgr.lookup(KEY, req) is not LookupResult.HIT
    mgr.complete_store(result.keys_to_store, req, success=False)
    assert mgr.lookup(KEY, req) is LookupResult.MISS


def test_the_plain_calls_still_take_any_iterable_and_a_request_subclass(mgr: TieringManager) -> None:
    class Mine(RequestContext):
        pass

    req = Mine("r")
    result = mgr.prepare_store(iter([KEY]), req)
    assert result is not None and result.keys_to_store == [KEY]
    mgr.complete_store(tuple(result.keys_to_store), req, True)
    assert mgr.lookup_prefix(iter([KEY]), req).ready == 1
    mgr.on_request_finished(req)


@pytest.mark.parametrize("req_id", [["a"], {"id": 1}, {1, 2}], ids=["list", "dict", "set"])
def test_a_request_id_that_cannot_be_a_key_is_refused_where_the_request_is_made(req_id: Any) -> None:
    """Regression (review, 2026-12-05): RequestContext(["a"]) was accepted, then prepare_store,
    on_new_request and on_request_finished failed deep inside with "unhashable type: 'list'",
    while lookup answered MISS. Ids of other hashable types stay accepted (see
    test_request_params_untrusted)."""
    with pytest.raises(TypeError, match=f"RequestContext.req_id must be a str.*got {type(req_id).__name__}"):
        RequestContext(req_id)


@pytest.mark.parametrize("call", ["prepare_load", "complete_load", "touch"])
def test_the_load_calls_name_a_request_that_is_not_a_request_context(call: str, namespace: Namespace) -> None:
    """Regression (audit, 2026-12-05): prepare_load and touch raised AttributeError ("'str' object
    has no attribute 'req_id'", touch only with a secondary tier and after touching the CPU
    tier) and complete_load ignored the request, where the other calls raise a TypeError."""
    manager = TieringManager.create(namespace=namespace, num_cpu_blocks=8, tiers=[{"type": "memory"}])
    try:
        result = manager.prepare_store([KEY])
        assert result is not None
        manager.complete_store([KEY])
        before = manager.primary.ref_count(KEY)  # the cascade's pin, while the memory tier copies
        with pytest.raises(TypeError, match=f"{call}: request must be a RequestContext"):
            getattr(manager, call)([KEY], "req")
        assert manager.primary.ref_count(KEY) == before  # nothing pinned, nothing released
    finally:
        manager.shutdown()
