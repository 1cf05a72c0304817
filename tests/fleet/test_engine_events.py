"""The engine side of the fleet's events: control records (their wire form and what a hostile
one gets), and EngineEventStream over a real TieringManager: the hello, seq without gaps,
events stamped with the start, clears on reset, snapshots in bounded parts that skip keys gone
meanwhile, a snapshot request's rate limit, an overflowing CPU event queue, marks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fleet_helpers import NS, Engine, prompt_keys

from kvtier.engine_events import CONTROL_PREFIX, ControlRecord, EngineEventStream, TierInfo, store_id
from kvtier.manager import TieringManager
from kvtier.types import BlockEvent

pytestmark = pytest.mark.usefixtures("shm_leak_check")


def _records(items: list[object]) -> list[ControlRecord]:
    return [i for i in items if isinstance(i, ControlRecord)]


def test_a_control_record_survives_its_string_form() -> None:
    tiers = (TierInfo("0:primary", "cpu", "cpu", "engine"), TierInfo("1:fs", "fs", "disk", "shared", "ab" * 12))
    record = ControlRecord("snapshot", "engine-1", "f00d", 7, 1700000000.5, tiers, {"tokens_per_hash": 32},
                           tier="1:fs", part=2, last=True, complete=True, reason="request")  # fmt: skip
    text = record.encode()
    assert text.startswith(CONTROL_PREFIX)
    assert ControlRecord.decode(text) == record
    assert ControlRecord.decode("1:fs") is None and ControlRecord.decode("") is None


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        "[1, 2]",
        json.dumps({"op": "reboot", "engine": "e", "start": "s", "seq": 0}),
        json.dumps({"op": "events", "engine": "e", "start": "s", "seq": -1}),
        json.dumps({"op": "events", "engine": "e", "start": "s", "seq": True}),
        json.dumps({"op": "events", "engine": "", "start": "s", "seq": 0}),
        json.dumps({"op": "events", "engine": "e" * 300, "start": "s", "seq": 0}),
        json.dumps({"op": "clear", "engine": "e", "start": "s", "seq": 0, "tier": "9:x", "tiers": []}),
        json.dumps({"op": "events", "engine": "e", "start": "s", "seq": 0,
                    "tiers": [{"label": "1:fs", "type": "fs", "medium": "disk", "scope": "galaxy"}]}),
        json.dumps({"op": "events", "engine": "e", "start": "s", "seq": 0,
                    "tiers": [{"label": "1:fs", "type": "fs", "medium": "disk", "scope": "shared"}]}),
        json.dumps({"op": "snapshot", "engine": "e", "start": "s", "seq": 0, "tier": "0:primary", "part": 0,
                    "reason": "whim", "tiers": [{"label": "0:primary", "type": "cpu", "medium": "cpu",
                                                 "scope": "engine"}]}),
        json.dumps({"op": "mark", "engine": "e", "start": "s", "seq": 0, "marker": 5}),
        "[" * 100000,
    ],
)  # fmt: skip
def test_a_malformed_control_record_is_refused_by_name(body: str) -> None:
    with pytest.raises(ValueError):
        ControlRecord.decode(CONTROL_PREFIX + body)


def test_store_ids_agree_for_the_same_location_and_namespace_only() -> None:
    assert store_id("fs:/nvme/kv", NS.hexdigest) == store_id("fs:/nvme/kv", NS.hexdigest)
    assert store_id("fs:/nvme/kv", NS.hexdigest) != store_id("fs:/nvme/kv2", NS.hexdigest)
    assert store_id("fs:/nvme/kv", NS.hexdigest) != store_id("fs:/nvme/kv", "00" * 32)


def test_stream_stamps_every_take_with_its_start_and_gapless_seq(tmp_path: Path) -> None:
    engine = Engine("e1", tmp_path / "root")
    try:
        first = engine.stream.take()
        hello = first[0]
        assert isinstance(hello, ControlRecord) and hello.op == "hello" and hello.seq == 0
        assert [t.label for t in hello.tiers] == ["0:primary", "1:fs"]
        assert hello.tiers[1].scope == "shared" and hello.tiers[1].store is not None
        assert hello.tiers[0].scope == "engine"
        # the fs tier lists its holdings once scanned: an empty root announces itself at once
        assert [(r.op, r.tier, r.last) for r in _records(first)[1:]] == [("snapshot", "1:fs", True)]
        seqs = [r.seq for r in _records(first)]
        keys = prompt_keys(seed=1, blocks=4)
        engine.store(keys)
        engine.settle()
        items = engine.stream.take()
        assert isinstance(items[0], ControlRecord)
        events = [i for i in items if isinstance(i, BlockEvent)]
        stored = {k for e in events if not e.removed for k in e.keys}
        assert stored == set(keys)
        fs_events = [i for i, item in enumerate(items) if isinstance(item, BlockEvent) and item.tier == "1:fs"]
        for i in fs_events:  # each shared-store change has its own timed record
            record = items[i - 1]
            assert isinstance(record, ControlRecord) and record.op == "events" and record.time == items[i].time > 0
        seqs += [r.seq for r in _records(items)]
        assert seqs == list(range(len(seqs)))
        assert all(r.start == engine.stream.start and r.engine == "e1" for r in _records(items))
        assert engine.stream.take() == []
        assert not engine.stream.has_pending_output()
    finally:
        engine.shutdown()


def test_reset_clears_the_cpu_tier_after_its_removals(tmp_path: Path) -> None:
    engine = Engine("e1", tmp_path / "root")
    try:
        engine.stream.take()
        keys = prompt_keys(seed=2, blocks=3)
        engine.store(keys)
        engine.settle()
        engine.stream.take()
        engine.stream.reset_cache()
        assert engine.stream.has_pending_output()
        items = engine.stream.take()
        removed = [i for i in items if isinstance(i, BlockEvent) and i.removed and i.tier == "0:primary"]
        assert {k for e in removed for k in e.keys} == set(keys)
        clear = [r for r in _records(items) if r.op == "clear"]
        assert [c.tier for c in clear] == ["0:primary"]
        assert items.index(clear[0]) > items.index(removed[-1])
    finally:
        engine.shutdown()


def test_snapshot_goes_in_bounded_parts_and_skips_what_left_meanwhile(tmp_path: Path) -> None:
    mgr = TieringManager.create(namespace=NS, num_cpu_blocks=16)
    try:
        stream = EngineEventStream(mgr, engine="e", part_keys=3, snapshot_interval=60.0)
        stream.take()
        keys = prompt_keys(seed=3, blocks=8)
        result = mgr.prepare_store(keys, None)
        assert result is not None
        mgr.complete_store(keys, None)
        stream.take()
        assert stream.request_snapshot()
        assert not stream.request_snapshot()  # one at a time, and at most every snapshot_interval
        first = stream.take()
        header = _records(first)
        assert [(r.op, r.tier, r.part, r.last, r.reason, r.complete) for r in header] == [
            ("snapshot", "0:primary", 0, False, "request", True)
        ]
        sent = {k for i in first if isinstance(i, BlockEvent) for k in i.keys}
        assert len(sent) == 3
        more = prompt_keys(seed=4, blocks=12)  # evicts some of the first keys meanwhile
        assert mgr.prepare_store(more, None) is not None
        mgr.complete_store(more, None)
        unsent_left = {k for k in keys if k not in sent} & set(mgr.primary.ready_keys())
        assert unsent_left != {k for k in keys if k not in sent}
        parts = [first]
        while stream.has_pending_output():
            parts.append(stream.take())
        snapshots = [r for p in parts for r in _records(p) if r.op == "snapshot"]
        assert [r.part for r in snapshots] == [0, 1, 2] and snapshots[-1].last
        listed = {k for p in parts for i in p if isinstance(i, BlockEvent) and not i.removed for k in i.keys}
        assert listed - set(more) == sent | unsent_left
        assert max(len(i.keys) for p in parts for i in p if isinstance(i, BlockEvent) and not i.removed
                   and i.keys[0] in keys) <= 3  # fmt: skip
    finally:
        mgr.shutdown()


def test_an_overflowing_cpu_event_queue_is_followed_by_a_snapshot(tmp_path: Path) -> None:
    mgr = TieringManager.create(namespace=NS, num_cpu_blocks=8)
    try:
        mgr.primary._events = type(mgr.primary._events)(maxlen=2)
        stream = EngineEventStream(mgr, engine="e")
        stream.take()
        for seed in range(3):
            keys = prompt_keys(seed=10 + seed, blocks=2)
            mgr.prepare_store(keys, None)
            mgr.complete_store(keys, None)
        items = stream.take()
        snapshot = [r for r in _records(items) if r.op == "snapshot"]
        assert [(r.tier, r.reason, r.part) for r in snapshot] == [("0:primary", "overflow", 0)]
        after = items[items.index(snapshot[0]) + 1]
        assert isinstance(after, BlockEvent) and set(after.keys) == set(mgr.primary.ready_keys())
    finally:
        mgr.shutdown()


def test_a_mark_comes_after_everything_before_it(tmp_path: Path) -> None:
    mgr = TieringManager.create(namespace=NS, num_cpu_blocks=8)
    try:
        stream = EngineEventStream(mgr, engine="e")
        stream.take()
        keys = prompt_keys(seed=20, blocks=2)
        mgr.prepare_store(keys, None)
        mgr.complete_store(keys, None)
        stream.mark("m-1")
        with pytest.raises(ValueError):
            stream.mark("")
        items = stream.take()
        assert isinstance(items[-1], ControlRecord) and items[-1].marker == "m-1"
        assert any(isinstance(i, BlockEvent) and set(i.keys) == set(keys) for i in items[:-1])
    finally:
        mgr.shutdown()
