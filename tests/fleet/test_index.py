"""The fleet index's trust rules on hand-made event batches, and its answers: restarts drop the
old start's device cache and private tiers, gaps make an engine partial until a snapshot, kvtier
events without a control record are not attributed, a shared store takes several engines'
changes in any order (the latest wins), snapshots never revive a newer removal and a complete one
sweeps stale keys; longest prefixes per tier and over all tiers, chunked tiers included. The same
scenario on Redis (one writer, a reader) gives the same answers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvtier.fleet.masks as masks_module
from kvtier.engine_events import ControlRecord, TierInfo
from kvtier.fleet import FleetIndex, FleetReader, MemoryMasks, RedisMasks, longest_prefix
from kvtier.fleet.index import prefix_answer
from kvtier.fleet.records import Kind, WireBatch, WireEvent

CPU = TierInfo("0:primary", "cpu", "cpu", "engine")
FS = TierInfo("1:fs", "fs", "disk", "shared", "store-1")
TIERS = (CPU, FS)
NOW = time.time()


class Stream:
    """One engine start's control records, numbered like EngineEventStream's."""

    def __init__(self, engine: str, start: str, info: dict[str, Any] | None = None) -> None:
        self.engine, self.start, self.seq = engine, start, 0
        self.info = info or {"tokens_per_hash": 4, "blocks_per_chunk": 1}

    def record(self, op: str = "events", at: float | None = None, **fields: Any) -> WireEvent:
        tiers = () if op == "events" else TIERS
        info = {} if op == "events" else self.info
        rec = ControlRecord(op, self.engine, self.start, self.seq, NOW if at is None else at, tiers, info, **fields)
        self.seq += 1
        return WireEvent(Kind.CONTROL, control=ControlRecord.decode(rec.encode()))


def stored(keys: list[int], medium: str | None = "CPU", ownership: str | None = None) -> WireEvent:
    return WireEvent(Kind.STORED, tuple(keys), medium, ownership)


def removed(keys: list[int], medium: str | None = "CPU", ownership: str | None = None) -> WireEvent:
    return WireEvent(Kind.REMOVED, tuple(keys), medium, ownership)


def batch(*events: WireEvent) -> WireBatch:
    return WireBatch(NOW, list(events), 0)


@pytest.fixture(params=["memory", "redis"])
def index(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FleetIndex]:
    if request.param == "memory":
        yield FleetIndex(["a", "b"], lag_seconds=1.0)
        return
    from redis_servers import REDIS_SERVER, start_redis

    if REDIS_SERVER is None:
        pytest.skip("redis-server not found on PATH")
    import redis

    server = start_redis(tmp_path / "redis")
    try:
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        yield FleetIndex(["a", "b"], RedisMasks(client, "t"), lag_seconds=1.0)
    finally:
        server.stop()


def test_device_and_cpu_events_and_a_restart(index: FleetIndex) -> None:
    a = Stream("a", "s1")
    index.apply("a", batch(stored([1, 2, 3], medium="GPU"), a.record("hello"), stored([1, 2]),
                           stored([10], "STORAGE", "1:fs")))  # fmt: skip
    assert index.engine("a").status == "synced"
    assert index.held("a", "GPU") == {1, 2, 3} and index.held("a", "0:primary") == {1, 2}
    index.apply("a", batch(removed([3], medium="GPU"), WireEvent(Kind.CLEARED), a.record(), removed([2])))
    assert index.held("a", "GPU") == set() and index.held("a", "0:primary") == {1}
    # the GPU events of the new start's first batch come before its hello: they are the new start's
    a2 = Stream("a", "s2")
    index.apply("a", batch(stored([7], medium="GPU"), a2.record("hello")))
    state = index.engine("a")
    assert state.restarts == 1 and state.start == "s2" and state.status == "synced"
    assert index.held("a", "GPU") == {7} and index.held("a", "0:primary") == set()
    assert index.held("a", "1:fs") == {10}  # the shared store outlives the start


def test_events_without_a_control_record_are_not_attributed(index: FleetIndex) -> None:
    a = Stream("a", "s1")
    index.apply("a", batch(stored([1])))  # another connector's CPU event, or one before any record
    assert index.engine("a").unattributed == 1 and index.engine("a").status == "waiting"
    index.apply("a", batch(a.record("hello"), stored([2], "STORAGE", "9:unknown")))
    assert index.engine("a").unattributed == 2 and index.held("a", "0:primary") == set()


def test_a_gap_makes_the_engine_partial_until_a_snapshot(index: FleetIndex) -> None:
    a = Stream("a", "s1")
    index.apply("a", batch(a.record("hello"), stored([1, 2]), stored([5], medium="GPU")))
    a.record()  # lost
    index.apply("a", batch(a.record(), stored([3])))
    state = index.engine("a")
    assert state.gaps == 1 and state.status == "partial" and not state.private_complete
    assert index.held("a", "0:primary") == {3} and index.held("a", "GPU") == set()
    # wanted until a snapshot arrives whole (review r9: an ask the engine refused was never repeated)
    assert index.take_snapshot_wanted("a") and index.take_snapshot_wanted("a")
    index.apply("a", batch(a.record("snapshot", tier="0:primary", part=0, last=False, complete=True, reason="request"),
                           stored([1, 2]),
                           a.record("snapshot", tier="0:primary", part=1, last=True, complete=True, reason="request"),
                           stored([3])))  # fmt: skip
    assert index.engine("a").private_complete and index.held("a", "0:primary") == {1, 2, 3}
    assert not index.take_snapshot_wanted("a")
    index.apply("a", batch(WireEvent(Kind.CLEARED)))
    assert index.engine("a").status == "synced"


def test_joining_mid_start_is_partial_and_clear_empties_a_private_tier(index: FleetIndex) -> None:
    a = Stream("a", "s1")
    a.seq = 40
    index.apply("a", batch(a.record("mark", marker="m"), stored([1])))
    assert index.engine("a").status == "partial" and index.take_snapshot_wanted("a")
    assert list(index.engine("a").marks) == ["m"]
    index.apply("a", batch(a.record("clear", tier="0:primary")))
    assert index.held("a", "0:primary") == set()


def test_a_shared_store_takes_two_engines_changes_in_any_order(index: FleetIndex) -> None:
    a, b = Stream("a", "sa"), Stream("b", "sb")
    index.apply("a", batch(a.record("hello")))
    index.apply("b", batch(b.record("hello")))
    # b removed key 1 at NOW-5, a stored it again at NOW-4: b's event arrives last
    index.apply("a", batch(a.record(at=NOW - 4), stored([1], "STORAGE", "1:fs")))
    index.apply("b", batch(b.record(at=NOW - 5), removed([1], "STORAGE", "1:fs")))
    assert index.held("a", "1:fs") == index.held("b", "1:fs") == {1}
    # a stored key 2 at NOW-5, b evicted it at NOW-3: the removal arrives first
    index.apply("b", batch(b.record(at=NOW - 3), removed([2], "STORAGE", "1:fs")))
    index.apply("a", batch(a.record(at=NOW - 5), stored([2], "STORAGE", "1:fs")))
    assert 2 not in index.held("a", "1:fs")
    # a snapshot listing key 2 (taken now, so counting as NOW - lag) does not revive the removal
    index.apply("b", batch(b.record("snapshot", tier="1:fs", part=0, last=True, complete=False, reason="request",
                                    at=NOW - 2.5), stored([2, 3], "STORAGE", "1:fs")))  # fmt: skip
    assert index.held("b", "1:fs") == {1, 3}
    # an engine's clock far ahead does not outrank the others forever: times are capped at now
    index.apply("a", batch(a.record(at=NOW + 3600), stored([4], "STORAGE", "1:fs")))
    index.apply("b", batch(b.record(at=time.time() + 0.5), removed([4], "STORAGE", "1:fs")))
    assert 4 not in index.held("a", "1:fs")


def test_an_incomplete_snapshot_of_a_shared_store_only_fills_gaps(index: FleetIndex) -> None:
    """Review (2026-12-04): an S3 tier's snapshot lists what its existence index knows, learned
    up to ``hit_seconds`` (an hour) before it; counted as the snapshot's time less the lag, it
    revived a removal the index had applied since. What such a listing says of a key with a
    change on record is older than that change, or no news."""
    a, b = Stream("a", "sa"), Stream("b", "sb")
    index.apply("a", batch(a.record("hello")))
    index.apply("b", batch(b.record("hello")))
    index.apply("a", batch(a.record(at=NOW - 60), stored([1, 2], "STORAGE", "1:fs")))
    index.apply("b", batch(b.record(at=NOW - 10), removed([1], "STORAGE", "1:fs")))
    index.apply("a", batch(a.record("snapshot", tier="1:fs", part=0, last=True, complete=False, reason="request",
                                    at=NOW), stored([1, 2, 7], "STORAGE", "1:fs")))  # fmt: skip
    assert index.held("a", "1:fs") == index.held("b", "1:fs") == {2, 7}  # before: {1, 2, 7}


def test_a_replayed_old_change_never_beats_a_newer_one(index: FleetIndex) -> None:
    """An index joining while engines run replays their buffers, minutes of changes, one engine
    after the other (review D5: times older than 4 lags were pruned, and then any change won)."""
    a, b = Stream("a", "sa"), Stream("b", "sb")
    index.apply("a", batch(a.record("hello", at=NOW - 100)))
    index.apply("b", batch(b.record("hello", at=NOW - 100)))
    # a's replay first: its removal of key 1 at NOW-80, then other changes up to NOW-10
    index.apply("a", batch(a.record(at=NOW - 80), removed([1], "STORAGE", "1:fs")))
    index.apply("a", batch(a.record(at=NOW - 10), stored([2], "STORAGE", "1:fs")))
    # then b's replay: its store of key 1 at NOW-90, older than a's removal
    index.apply("b", batch(b.record(at=NOW - 90), stored([1], "STORAGE", "1:fs")))
    assert index.held("b", "1:fs") == {2}  # before the fix: {1, 2}, though the store no longer held 1


def test_past_max_times_an_old_store_of_a_forgotten_key_is_not_applied() -> None:
    index = FleetIndex(["a", "b"], max_times=2)
    a, b = Stream("a", "sa"), Stream("b", "sb")
    index.apply("a", batch(a.record("hello", at=NOW - 100)))
    index.apply("b", batch(b.record("hello", at=NOW - 100)))
    index.apply("a", batch(a.record(at=NOW - 80), removed([1], "STORAGE", "1:fs")))
    index.apply("a", batch(a.record(at=NOW - 10), stored([2, 3, 4], "STORAGE", "1:fs")))  # key 1's time forgotten
    index.apply("b", batch(b.record(at=NOW - 90), stored([1], "STORAGE", "1:fs")))
    index.apply("b", batch(b.record(at=NOW - 5), stored([5], "STORAGE", "1:fs")))  # newer than all forgotten: applied
    assert index.held("b", "1:fs") == {2, 3, 4, 5}


@pytest.mark.parametrize("medium", ["cpu", "LocalDiskBackend", "gpu"])
def test_block_events_of_another_connectors_medium_are_skipped_and_counted(index: FleetIndex, medium: str) -> None:
    a = Stream("a", "s1")
    index.apply("a", batch(a.record("hello"), stored([1, 2, 3], medium=medium), removed([4], medium=medium)))
    state = index.engine("a")
    assert index.held("a", "GPU") == set() and state.skipped == 2  # before the fix: GPU {1, 2, 3}
    index.apply("a", batch(a.record(), stored([5], medium=None), stored([6], medium="GPU")))
    assert index.held("a", "GPU") == {5, 6}  # (no medium: vLLM before media, the device cache)


def test_a_complete_snapshot_sweeps_stale_keys_but_not_recent_changes(index: FleetIndex) -> None:
    a, b = Stream("a", "sa"), Stream("b", "sb")
    index.apply("a", batch(a.record("hello"), a.record(at=NOW - 30), stored([1, 2, 3], "STORAGE", "1:fs")))
    index.apply("b", batch(b.record("hello"), b.record(at=NOW - 0.2), stored([9], "STORAGE", "1:fs")))
    # a's snapshot lists 1 and 2: 3 was removed in events the index never got; 9 is newer than it
    index.apply("a", batch(a.record("snapshot", tier="1:fs", part=0, last=True, complete=True, reason="start",
                                    at=NOW), stored([1, 2], "STORAGE", "1:fs")))  # fmt: skip
    assert index.held("a", "1:fs") == {1, 2, 9}
    # an incomplete listing sweeps nothing
    index.apply("b", batch(b.record("snapshot", tier="1:fs", part=0, last=True, complete=False, reason="start",
                                    at=NOW + 0.1), stored([1], "STORAGE", "1:fs")))  # fmt: skip
    assert index.held("a", "1:fs") == {1, 2, 9}


def test_longest_prefix_per_tier_and_over_all_tiers(index: FleetIndex) -> None:
    a = Stream("a", "sa", {"tokens_per_hash": 4, "blocks_per_chunk": 2})
    index.apply("a", batch(a.record("hello"), stored([10, 11], medium="GPU"), stored([13, 15]),
                           a.record(at=NOW - 1), stored([17], "STORAGE", "1:fs")))  # fmt: skip
    keys = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    answer = index.prefix(keys)["a"]
    # chunks of two blocks are keyed by their last block: 11 (GPU only), 13, 15 (CPU), 17 (fs)
    assert answer["tiers"] == {"GPU": 2, "0:primary": 0, "1:fs": 0}
    assert answer["blocks"] == 8  # GPU 10-11, CPU chunk 12-13, CPU chunk 14-15, fs chunk 16-17
    assert index.prefix([12, 13])["a"]["tiers"]["0:primary"] == 2
    assert index.prefix([])["a"]["blocks"] == 0
    assert index.prefix(keys, engines=["b", "nobody"]) == {"b": {"blocks": 0, "tiers": {"GPU": 0}, "status": "waiting",
                                                                  "start": None}}  # fmt: skip
    reader = FleetReader(index.masks, meta_ttl=0.0)
    assert reader.prefix(keys) == index.prefix(keys)


def test_a_memory_index_counts_what_it_dropped() -> None:
    masks = MemoryMasks()
    index = FleetIndex(["a"], masks)
    a = Stream("a", "s1")
    index.apply("a", batch(a.record("hello"), stored(list(range(100)))))
    assert masks.count(index.engine("a").bits["0:primary"]) == 100
    index.apply("a", batch(Stream("a", "s2").record("hello")))
    assert len(masks) == 0
    with pytest.raises(ValueError):
        index.add_engine("a")


class _ReadAfterEachHold:
    """A lock (a collaborator double) that reads the masks, as a router's answer would, each time
    the thread holding it lets it go (not for the reads' own holds)."""

    def __init__(self, read: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._read = read
        self._reading = False

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        if not self._reading:
            self._reading = True
            try:
                self._read()
            finally:
                self._reading = False


def test_a_large_location_is_hidden_at_once_and_cleared_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Left alone until 2026-12-04: clearing a location (an engine restarted, or lost events) held
    the lock answers read under for all its keys, about 0.1 s per million keys. Now answers stop
    showing it at once and get the lock between chunks of its keys."""
    monkeypatch.setattr(masks_module, "CLEAR_CHUNK", 10)
    store = MemoryMasks(max_keys=40)
    keys = list(range(35))
    store.add(1, keys)
    store.add(2, keys[:5])
    seen: list[list[int]] = []
    store._lock = _ReadAfterEachHold(lambda: seen.append(store.masks(keys)))  # type: ignore[assignment]
    store.clear(1)
    after = [4] * 5 + [0] * 30  # only bit 2's keys, as bit 2
    assert len(seen) == 1 + 4 + 1, "the lock let go after taking the location, after each of 4 chunks, at the end"
    assert all(answer == after for answer in seen), "no answer shows a location once its clear began"
    assert store.masks(keys) == after and store.count(1) == 0 and len(store) == 5
    store.add(1, range(100, 135))  # its 35 entries are free again (max_keys 40, 5 held)
    assert store.count(1) == 35


def _reference(masks: list[int], device: int, tiers: dict[str, int], chunk: int) -> dict[str, Any]:
    """The answer spelled out the slow way: each prefix walked on its own."""

    def run(flag: int, step: int) -> int:
        blocks = step - 1
        while blocks < len(masks) and masks[blocks] & flag:
            blocks += step
        return blocks - step + 1

    any_tier = 0
    for flag in tiers.values():
        any_tier |= flag
    blocks = 0
    while blocks < len(masks):
        if masks[blocks] & device:
            blocks += 1
            continue
        end = (blocks // chunk + 1) * chunk - 1
        if end < len(masks) and masks[end] & any_tier:
            blocks = end + 1
            continue
        break
    return {"blocks": blocks, "tiers": {"GPU": run(device, 1), **{label: run(f, chunk) for label, f in tiers.items()}}}


@given(
    masks=st.lists(st.integers(0, 15), max_size=40),
    chunk=st.integers(1, 4),
    window=st.integers(1, 8),
)
def test_the_one_pass_answer_equals_each_prefix_walked_alone(masks: list[int], chunk: int, window: int) -> None:
    meta = {"engines": {"e": {"device_bit": 0, "info": {"blocks_per_chunk": chunk}, "status": "synced",
                              "start": "s", "tiers": [{"label": "0:primary", "bit": 1}, {"label": "1:fs", "bit": 2},
                                                      {"label": "2:redis", "bit": 3}]}}}  # fmt: skip
    masks_store = MemoryMasks()
    keys = list(range(len(masks)))
    for bit in range(4):
        masks_store.add(bit, [k for k, m in zip(keys, masks, strict=True) if m >> bit & 1])
    want = _reference(masks, 1, {"0:primary": 2, "1:fs": 4, "2:redis": 8}, chunk)
    got = longest_prefix(meta, masks)["e"]
    lazy = prefix_answer(meta, masks_store, keys, first_window=window)["e"]
    assert {"blocks": got["blocks"], "tiers": got["tiers"]} == want
    assert lazy == got


def test_the_keys_a_shared_store_snapshot_lists_are_bounded_by_max_keys() -> None:
    """Regression (review r9, 2026-12-03): the keys a complete snapshot of a shared store lists are
    held until its last part (to drop what it does not list), applied or not; keys older than the
    change times the index forgot are not applied, so an engine sending such a snapshot that never
    ends grew that set without bound, past ``max_keys``, while it stayed ``synced``."""

    def rec(op: str, seq: int, at: float, **fields: Any) -> WireEvent:
        record = ControlRecord(op, "e", "s1", seq, at, (FS,), {"tokens_per_hash": 16}, **fields)
        return WireEvent(Kind.CONTROL, control=ControlRecord.decode(record.encode()))

    index = FleetIndex(["a"], MemoryMasks(max_keys=10), max_times=4)
    index.apply("a", WireBatch(NOW, [rec("hello", 0, NOW)], 0))
    # removals of keys never stored fill the change times; forgetting the oldest sets the floor
    index.apply("a", WireBatch(NOW, [rec("events", 1, NOW - 100), WireEvent(Kind.REMOVED, tuple(range(5)), "STORAGE",
                                                                            "1:fs")], 0))  # fmt: skip
    snapshot = {"tier": "1:fs", "last": False, "complete": True, "reason": "request"}
    index.apply("a", WireBatch(NOW, [rec("snapshot", 2, NOW - 200, part=0, **snapshot)], 0))
    for part in (1, 2):  # older than the floor: nothing applied, all listed
        keys = tuple(range(1000 * part, 1000 * part + 8))
        index.apply("a", WireBatch(NOW, [rec("snapshot", 2 + part, NOW - 200, part=part, **snapshot),
                                         WireEvent(Kind.STORED, keys, "STORAGE", "1:fs")], 0))  # fmt: skip
    assert sum(len(listed) for _, listed in index._sweeps.values()) <= 10
    assert index.engine("a").status == "partial" and index.engine("a").skipped >= 1


def test_a_snapshot_that_lost_a_part_leaves_the_engine_partial_and_wanting_one() -> None:
    """Regression (review r9, 2026-12-03): a part of a CPU-tier snapshot lost (a gap) dropped the
    tier, yet the snapshot's last part then marked it complete: the engine turned ``synced``
    while the index missed the blocks of the parts before the gap."""
    index = FleetIndex(["a"])
    a = Stream("a", "s1")
    index.apply("a", batch(a.record("hello"), stored([1, 2, 3, 4])))
    a.record()  # lost: a gap, the engine wants a snapshot
    index.apply("a", batch(a.record(), stored([5])))
    snapshot = {"tier": "0:primary", "complete": True, "reason": "request"}
    index.apply("a", batch(a.record("snapshot", part=0, last=False, **snapshot), stored([1, 2])))
    a.record("snapshot", part=1, last=False, **snapshot)  # lost
    index.apply("a", batch(a.record("snapshot", part=2, last=True, **snapshot), stored([4, 5])))
    index.apply("a", batch(WireEvent(Kind.CLEARED)))
    eng = index.engine("a")
    assert eng.status == "partial" and not eng.private_complete and index.take_snapshot_wanted("a")
    index.apply("a", batch(a.record("snapshot", part=0, last=False, **snapshot), stored([1, 2, 3]),
                           a.record("snapshot", part=1, last=True, **snapshot), stored([4, 5])))  # fmt: skip
    assert eng.status == "synced" and index.held("a", "0:primary") == {1, 2, 3, 4, 5}
    assert not index.take_snapshot_wanted("a")
