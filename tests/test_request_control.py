"""Per-request control: the tiers a request loads from, whether and where its blocks are stored."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier import LookupResult, Namespace, RequestContext, TieringManager, prefix_keys
from kvtier.request_control import RequestControlError, TierDescriptor, parse_control, select_tiers
from kvtier.tiers.registry import register_tier
from kvtier.types import RequestControl
from tier_doubles import ScriptedTier

HIT, HIT_PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS


class _RemoteTier(ScriptedTier):
    tier_type = "far"
    medium = "remote"


register_tier("scripted", "tier_doubles:ScriptedTier")
register_tier("far", "test_request_control:_RemoteTier")

TIERS = [
    TierDescriptor(0, "0:primary", "primary", "local"),
    TierDescriptor(1, "1:fs", "fs", "local"),
    TierDescriptor(2, "2:redis", "redis", "remote"),
    TierDescriptor(3, "3:fs", "fs", "local"),
]


def keys(n: int, seed: int = 0) -> list[bytes]:
    return prefix_keys(np.arange(n * 4) + seed * 100_000, 4)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("cpu", {0}),
        (["primary"], {0}),
        (["0:primary", "2:redis"], {0, 2}),
        (["fs"], {1, 3}),
        (["1:FS"], {1}),
        (["local"], {0, 1, 3}),
        (["remote"], {2}),
        (["all"], {0, 1, 2, 3}),
        ([], set()),
    ],
)
def test_selectors(raw: object, expected: set[int]) -> None:
    assert select_tiers("kvtier_load_tiers", raw, TIERS) == expected


def test_bad_selectors_name_the_key_and_the_choices() -> None:
    with pytest.raises(RequestControlError, match=r"kvtier_load_tiers names 's3'.*'1:fs'.*'cpu'"):
        select_tiers("kvtier_load_tiers", ["cpu", "s3"], TIERS)
    with pytest.raises(RequestControlError, match="must be a list of tier selectors"):
        select_tiers("kvtier_cascade_tiers", {"fs": True}, TIERS)
    with pytest.raises(RequestControlError, match="must be a list of tier selectors"):
        select_tiers("kvtier_cascade_tiers", [1], TIERS)


def test_parse_keeps_good_keys_when_one_is_bad() -> None:
    control, errors = parse_control({"kvtier_load_tiers": ["nope"], "kvtier_store": False}, TIERS)
    assert control == RequestControl(load_from=None, store=False, cascade_to=None)
    assert len(errors) == 1 and "nope" in errors[0]
    control, errors = parse_control({"kvtier_store": "no", "kvtier_cascade_tiers": ["cpu", "redis"]}, TIERS)
    assert control.store and control.cascade_to == {2}
    assert errors == ["kvtier_store must be true or false, got 'no'"]
    # selecting everything is the default
    control, errors = parse_control({"kvtier_load_tiers": ["all"], "kvtier_cascade_tiers": ["fs", "remote"]}, TIERS)
    assert control.is_default and not errors


@pytest.fixture
def mgr(namespace: Namespace, private_shm: Path) -> Iterator[TieringManager]:
    manager = TieringManager.create(
        namespace=namespace, num_cpu_blocks=16, shm_dir=private_shm,
        tiers=[{"type": "scripted", "name": "near"}, {"type": "far", "name": "far"}],
    )
    yield manager
    manager.shutdown()


def _store(mgr: TieringManager, ks: list[bytes], req: RequestContext) -> list[bytes]:
    result = mgr.prepare_store(ks, req)
    assert result is not None
    for slot in result.slots:
        mgr.rows[int(slot), : mgr.block_bytes] = 9
    mgr.complete_store(result.keys_to_store, req)
    mgr.on_schedule_end()
    return list(result.keys_to_store)


def test_load_tiers_restrict_where_a_request_loads_from(mgr: TieringManager) -> None:
    near, far = mgr.tiers
    assert isinstance(near, ScriptedTier) and isinstance(far, ScriptedTier)
    k_near, k_far, k_cpu = keys(3)
    near.data[k_near] = far.data[k_far] = bytes(mgr.block_bytes)
    _store(mgr, [k_cpu], RequestContext("writer", {"kvtier_cascade_tiers": []}))

    local_only = RequestContext("latency-critical", {"kvtier_load_tiers": ["local"]})
    assert mgr.lookup(k_far, local_only) is MISS, "the remote tier is not asked"
    assert mgr.lookup(k_near, local_only) is HIT_PENDING
    assert mgr.lookup(k_cpu, local_only) is HIT
    assert local_only.control == RequestControl(load_from=frozenset({0, 1}))

    cpu_only = RequestContext("cpu-only", {"kvtier_load_tiers": "cpu"})
    assert mgr.lookup(k_far, cpu_only) is MISS
    assert mgr.lookup(k_cpu, cpu_only) is HIT

    nothing = RequestContext("recompute", {"kvtier_load_tiers": []})
    assert mgr.lookup(k_cpu, nothing) is MISS, "without the CPU tier nothing can be loaded"

    anyone = RequestContext("default")
    assert mgr.lookup(k_far, anyone) is HIT_PENDING
    assert mgr.stats().manager.promotions_started == 2


def test_store_false_stores_nothing_and_cascade_tiers_choose_the_tiers(mgr: TieringManager) -> None:
    near, far = mgr.tiers
    assert isinstance(near, ScriptedTier) and isinstance(far, ScriptedTier)
    one_off = RequestContext("one-off", {"kvtier_store": False})
    result = mgr.prepare_store(keys(3), one_off)
    assert result is not None and result.keys_to_store == [] and len(result.slots) == 0
    assert len(mgr.primary) == 0 and mgr.stats().manager.stores_declined == 3

    cpu_only = RequestContext("cpu-only", {"kvtier_cascade_tiers": []})
    stored = _store(mgr, keys(2, seed=1), cpu_only)
    assert len(stored) == 2 and not near.data and not far.data

    remote_only = RequestContext("remote-only", {"kvtier_cascade_tiers": ["remote"]})
    stored = _store(mgr, keys(2, seed=2), remote_only)
    assert not near.data and set(far.data) == set(stored)

    everywhere = RequestContext("default")
    stored = _store(mgr, keys(2, seed=3), everywhere)
    assert set(near.data) == set(stored) and set(stored) <= set(far.data)


def test_malformed_control_is_logged_once_and_ignored(
    mgr: TieringManager, caplog: pytest.LogCaptureFixture
) -> None:
    near = mgr.tiers[0]
    assert isinstance(near, ScriptedTier)
    with caplog.at_level(logging.WARNING, logger="kvtier.manager"):
        for i in range(3):
            req = RequestContext(f"r{i}", {"kvtier_cascade_tiers": ["s3"]})
            _store(mgr, keys(1, seed=10 + i), req)
    assert len(near.data) == 3, "the bad setting fell back to its default: cascade everywhere"
    messages = [r.getMessage() for r in caplog.records if "kvtier_cascade_tiers" in r.getMessage()]
    assert len(messages) == 1 and "'s3'" in messages[0] and "ignored" in messages[0]
