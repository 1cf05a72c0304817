"""TieringManager's boundary (issue 9, item 5): keys are validated at every public entry, a
shut-down manager refuses every call but shutdown/is_shut_down/stats, and stats() never raises."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import tier_doubles
from kvtier import InvalidKeyError, KvtierError, ManagerClosedError, Namespace, RequestContext, TieringManager
from kvtier.tiers.format import MAX_KEY_BYTES
from kvtier.tiers.registry import register_tier
from kvtier.types import LookupResult
from tier_doubles import ScriptedTier

pytestmark = pytest.mark.usefixtures("shm_leak_check")
register_tier("scripted", "tier_doubles:ScriptedTier")


@pytest.fixture
def mgr(namespace: Namespace) -> Iterator[TieringManager]:
    tier_doubles.CALLS.clear()
    manager = TieringManager.create(namespace=namespace, num_cpu_blocks=8, tiers=[{"type": "scripted"}])
    yield manager
    manager.shutdown()
    tier_doubles.CALLS.clear()


def _store(mgr: TieringManager, keys: list[bytes], req: RequestContext | None = None) -> None:
    plan = mgr.prepare_store(keys, req)
    assert plan is not None
    rows = mgr.rows
    for i, slot in enumerate(plan.slots):
        rows[int(slot), :16] = i + 1
    del rows
    mgr.complete_store(plan.keys_to_store, req)


@pytest.mark.parametrize("length", [1, 8, 32, 36, 40, MAX_KEY_BYTES])
def test_keys_of_any_length_up_to_the_maximum_are_stored_as_they_are(mgr: TieringManager, length: int) -> None:
    assert MAX_KEY_BYTES >= 64
    key = bytes([length]) * length
    _store(mgr, [key])
    assert mgr.lookup(key) is LookupResult.HIT
    tier = mgr.tiers[0]
    assert isinstance(tier, ScriptedTier) and key in tier.data, "the tier got the key itself"


BAD_KEYS: list[Any] = [b"", b"x" * (MAX_KEY_BYTES + 1), "a-str-key", 12345, bytearray(b"k" * 32), None]


@pytest.mark.parametrize("bad", BAD_KEYS, ids=["empty", "too-long", "str", "int", "bytearray", "none"])
def test_a_bad_key_is_refused_at_every_entry_and_never_reaches_a_tier(mgr: TieringManager, bad: Any) -> None:
    good = b"g" * 32
    _store(mgr, [good])
    mgr.on_schedule_end()
    mgr.on_schedule_end()  # the next step polls the cascade and releases its pin
    tier = mgr.tiers[0]
    assert isinstance(tier, ScriptedTier)
    calls_before, touched_before = list(tier_doubles.CALLS), list(tier.touched)
    entries: list[Callable[[], object]] = [
        lambda: mgr.lookup(bad),
        lambda: mgr.lookup_prefix([good, bad]),
        lambda: mgr.prepare_load([good, bad]),
        lambda: mgr.complete_load([bad]),
        lambda: mgr.touch([good, bad]),
        lambda: mgr.prepare_store([good, bad]),
        lambda: mgr.complete_store([bad]),
    ]
    for call in entries:
        with pytest.raises(InvalidKeyError) as info:
            call()
        assert isinstance(info.value, ValueError) and isinstance(info.value, KvtierError)
        assert "key" in str(info.value)
    assert calls_before == tier_doubles.CALLS and tier.touched == touched_before
    assert mgr.primary.ref_count(good) == 0, "a refused prepare_load pinned nothing"
    assert len(mgr.primary) == 1, "a refused prepare_store reserved nothing"
    assert mgr.stats().as_dict()["manager"]["tier_call_errors"] == 0


def test_every_call_after_shutdown_raises_but_stats_and_shutdown_do_not(namespace: Namespace) -> None:
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=8, tiers=[{"type": "scripted"}])
    key = b"s" * 32
    req = RequestContext("r")
    _store(mgr, [key])
    mgr.shutdown()
    assert mgr.is_shut_down
    calls: dict[str, Callable[[], object]] = {
        "lookup": lambda: mgr.lookup(key),
        "lookup_prefix": lambda: mgr.lookup_prefix([key]),
        "prepare_load": lambda: mgr.prepare_load([key]),
        "complete_load": lambda: mgr.complete_load([key]),
        "touch": lambda: mgr.touch([key]),
        "prepare_store": lambda: mgr.prepare_store([b"n" * 32]),
        "complete_store": lambda: mgr.complete_store([key]),
        "on_new_request": lambda: mgr.on_new_request(req),
        "on_request_finished": lambda: mgr.on_request_finished(req),
        "on_schedule_end": lambda: mgr.on_schedule_end(),
        "has_pending_work": lambda: mgr.has_pending_work(),
        "take_events": lambda: mgr.take_events(),
        "reset_cache": lambda: mgr.reset_cache(),
        "jobs_in_flight": lambda: mgr.jobs_in_flight(),
    }
    for name, call in calls.items():
        with pytest.raises(ManagerClosedError, match=rf"{name}\(\) called after shutdown"):
            call()
    # What the message names as still answering does answer (it named only three; review 2026-12-03).
    with pytest.raises(ManagerClosedError) as raised:
        mgr.lookup(key)
    answering = {
        "is_shut_down": lambda: mgr.is_shut_down, "stats": mgr.stats, "is_idle": lambda: mgr.is_idle,
        "tier_descriptors": mgr.tier_descriptors, "tier_label": lambda: mgr.tier_label(0),
        "request_control": lambda: mgr.request_control(req), "telemetry": lambda: mgr.telemetry,
        "block_bytes": lambda: mgr.block_bytes,
    }  # fmt: skip
    for name, read in answering.items():
        assert name in str(raised.value)
        read()
    stats = mgr.stats().as_dict()
    assert stats["primary"]["capacity_blocks"] == 8
    mgr.shutdown()  # still a no-op


class _BrokenStatsTier(ScriptedTier):
    tier_type = "broken-stats"

    def usage(self) -> Any:
        raise RuntimeError("usage backend gone")

    def health(self) -> Any:
        raise OSError("health probe exploded")


register_tier("broken-stats", "test_manager_boundary:_BrokenStatsTier")


def test_stats_never_raises_when_a_tier_usage_or_health_raises(
    namespace: Namespace, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=8, tiers=[{"type": "broken-stats"}])
    try:
        with caplog.at_level(logging.ERROR, logger="kvtier.manager"):
            for _ in range(3):
                stats = mgr.stats().as_dict()
        entry = stats["tiers"]["1:broken-stats"]
        assert entry["class"] == "_BrokenStatsTier"
        assert "used_bytes" not in entry and "health" not in entry
        assert stats["manager"]["tier_call_errors"] == 6, "every failed call is counted"
        logged = [r.getMessage() for r in caplog.records]
        assert sum("usage()" in m for m in logged) == 1 and sum("health()" in m for m in logged) == 1
        from kvtier.metrics import KvtierMetrics

        metrics = KvtierMetrics()
        metrics.update(mgr)  # what the vLLM adapter does every interval: must not raise either
        metrics.close()
    finally:
        mgr.shutdown()


@pytest.mark.parametrize(
    ("where", "field", "value"),
    [("stats", "lookups_hit", "lots"), ("stats", "lookups_hit", float("nan")), ("stats", "evictions", None),
     ("stats", "stores_failed", float("inf")), ("stats", "seconds_writing", object()),
     ("usage", "used_bytes", "x"), ("usage", "capacity_bytes", float("nan")), ("usage", "entries", [1])],
    ids=["hits-str", "hits-nan", "evictions-none", "failed-inf", "seconds-object", "used-str", "capacity-nan",
         "entries-list"],
)
def test_stats_never_raises_when_a_tier_reports_a_figure_that_is_no_number(
    namespace: Namespace, where: str, field: str, value: Any
) -> None:
    """Regression (audit, 2026-12-05): a tier whose counters or usage held a string, None, NaN or inf
    made stats() raise (int() of it) or return a snapshot json.dumps refused; now that reading
    takes its safe default, counted as a failed call, like a tier whose stats() raises."""
    import json

    from kvtier.tiers.base import TierUsage

    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=8, tiers=[{"type": "memory"}])
    try:
        tier = mgr.tiers[0]
        if where == "stats":
            setattr(tier.stats, field, value)
        else:
            good = tier.usage()
            tier.usage = lambda: TierUsage(**{**good.__dict__, field: value})  # type: ignore[method-assign]
        entry = json.loads(json.dumps(mgr.stats().as_dict(), allow_nan=False))["tiers"]["1:memory"]
        assert ("lookups_hit" not in entry) if where == "stats" else ("used_bytes" not in entry)
        assert mgr.stats().manager.tier_call_errors == 2
        from kvtier.metrics import KvtierMetrics

        metrics = KvtierMetrics()
        metrics.update(mgr)
        metrics.close()
    finally:
        mgr.shutdown()


class _LyingKey(bytes):
    """A bytes subclass whose ``len`` says 8 whatever its bytes (and whose hash is its own)."""

    def __len__(self) -> int:
        return 8

    def __hash__(self) -> int:
        return 7


def test_a_bytes_subclass_key_is_measured_and_stored_as_plain_bytes(mgr: TieringManager) -> None:
    """Regression (review, 2026-12-02): a bytes subclass with a lying ``__len__`` got past the key
    check: a 200-byte key reached a tier, and the subclass object itself was the index's key."""
    with pytest.raises(InvalidKeyError):
        mgr.prepare_store([_LyingKey(b"x" * 200)])
    with pytest.raises(InvalidKeyError):
        mgr.lookup(_LyingKey(b"x" * 200))
    assert len(mgr.primary) == 0
    key = _LyingKey(b"k" * 32)  # a valid key: taken as its plain bytes
    _store(mgr, [key])
    mgr.on_schedule_end()
    mgr.on_schedule_end()
    plain = b"k" * 32
    assert mgr.lookup(plain) is LookupResult.HIT and mgr.lookup(key) is LookupResult.HIT
    tier = mgr.tiers[0]
    assert isinstance(tier, ScriptedTier)
    assert all(type(k) is bytes for k in tier.data) and plain in tier.data
    assert plain in mgr.primary and len(mgr.primary) == 1
