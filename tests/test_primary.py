"""PrimaryTier bookkeeping: ref counts, eviction rules, events."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.errors import KvtierError
from kvtier.policies import ARCPolicy
from kvtier.primary import PrimaryTier
from kvtier.region import SharedRegion
from kvtier.types import LookupResult
from tier_doubles import RecordingLRU

pytestmark = pytest.mark.usefixtures("shm_leak_check")


@pytest.fixture
def tier(request: pytest.FixtureRequest) -> Iterator[PrimaryTier]:
    region = SharedRegion(f"primary-{request.node.name[:40]}", 4, 4096)
    primary = PrimaryTier(region, 4096, max_pending_events=8)
    yield primary
    primary.shutdown()


def k(i: int) -> bytes:
    return i.to_bytes(32, "little")


def fill(tier: PrimaryTier, *ids: int) -> None:
    result = tier.prepare_store([k(i) for i in ids])
    assert result is not None
    tier.complete_store(result.keys_to_store)


def test_ref_count_states(tier: PrimaryTier) -> None:
    result = tier.prepare_store([k(1)])
    assert result is not None and tier.ref_count(k(1)) == -1
    assert tier.lookup(k(1)) is LookupResult.HIT_PENDING
    tier.complete_store([k(1)])
    assert tier.ref_count(k(1)) == 0 and tier.lookup(k(1)) is LookupResult.HIT
    tier.pin([k(1)])
    tier.pin([k(1)])
    assert tier.ref_count(k(1)) == 2
    tier.unpin([k(1)])
    tier.unpin([k(1)])
    assert tier.ref_count(k(1)) == 0
    tier.unpin([k(1)])  # an extra unpin is logged and ignored, never negative
    assert tier.ref_count(k(1)) == 0


def test_eviction_skips_pinned_in_flight_and_protected(tier: PrimaryTier) -> None:
    fill(tier, 1, 2, 3)
    assert tier.prepare_store([k(4)]) is not None  # in flight, last free row
    tier.pin([k(1)])
    tier.pin([k(2)])
    result = tier.prepare_store([k(5)])
    assert result is not None and result.evicted_keys == [k(3)]
    assert tier.prepare_store([k(6)]) is None, "only pinned and in-flight blocks remain"
    assert len(tier) == 4 and tier.stats.store_rejections == 1


def test_rejection_is_atomic(tier: PrimaryTier) -> None:
    fill(tier, 1, 2, 3, 4)
    tier.pin([k(1)])
    tier.pin([k(2)])
    before = {i: tier.slot_of(k(i)) for i in range(1, 5)}
    assert tier.prepare_store([k(7), k(8), k(9)]) is None
    assert {i: tier.slot_of(k(i)) for i in range(1, 5)} == before


def test_keys_being_stored_are_never_evicted_for_themselves(tier: PrimaryTier) -> None:
    fill(tier, 1, 2, 3, 4)
    result = tier.prepare_store([k(1), k(2), k(5), k(5)])
    assert result is not None and result.keys_to_store == [k(5)]
    assert k(1) in tier and k(2) in tier and len(result.evicted_keys) == 1


def test_failed_store_frees_row(tier: PrimaryTier) -> None:
    result = tier.prepare_store([k(1), k(2)])
    assert result is not None
    tier.complete_store([k(1), k(2)], success=False)
    assert len(tier) == 0 and tier.free_slots == 4
    assert tier.complete_store([k(1)]) == [], "stale completions are ignored"


def test_pin_of_in_flight_block_raises_and_rolls_back(tier: PrimaryTier) -> None:
    fill(tier, 1)
    assert tier.prepare_store([k(2)]) is not None
    with pytest.raises(KvtierError, match="still being written"):
        tier.pin([k(1), k(2)])
    assert tier.ref_count(k(1)) == 0


def test_events_are_bounded_when_nobody_takes_them(tier: PrimaryTier) -> None:
    # regression: an engine that never calls take_events must not grow memory forever
    for i in range(100):
        fill(tier, 1000 + i)
    events = tier.take_events()
    assert len(events) == 8
    assert tier.take_events() == []


def test_reset_forgets_everything_and_reports_removal(tier: PrimaryTier) -> None:
    fill(tier, 1, 2)
    tier.take_events()
    tier.reset()
    assert len(tier) == 0 and tier.free_slots == 4
    (event,) = tier.take_events()
    assert event.removed and set(event.keys) == {k(1), k(2)}


def test_reset_holds_out_the_rows_an_engine_copy_may_still_touch(tier: PrimaryTier) -> None:
    """A device store not completed and a device load not completed still copy into / out of
    their rows after a reset: no new write may get those rows until release_held()."""
    fill(tier, 1, 2)
    tier.prepare_load([k(1)])  # a device load reading k(1)'s row
    stored = tier.prepare_store([k(3)])  # a device store writing k(3)'s row
    assert stored is not None
    promoted = tier.reserve_one(k(4))  # a promotion reserved but never submitted: nobody writes it
    assert promoted is not None
    busy = {tier.slot_of(k(1)), tier.slot_of(k(3))}
    tier.reset()
    assert tier.held_count == 2 and tier.free_slots == 2
    rows = tier.prepare_store([k(10), k(11)])
    assert rows is not None and not busy & set(rows.slots.tolist())
    assert tier.prepare_store([k(12)]) is None  # the held rows are not evicted into either
    tier.complete_store(rows.keys_to_store)
    tier.reset()  # a second reset keeps holding them (and the completed store's rows are free again)
    assert tier.held_count == 2 and tier.free_slots == 2
    assert tier.release_held() == 2
    assert tier.held_count == 0 and tier.free_slots == 4
    rows = tier.prepare_store([k(20), k(21), k(22), k(23)])
    assert rows is not None and sorted(rows.slots.tolist()) == [0, 1, 2, 3]


@pytest.fixture
def recorded(private_shm: Path) -> Iterator[tuple[PrimaryTier, RecordingLRU]]:
    region = SharedRegion("primary-rec", 8, 4096, shm_dir=private_shm)
    policy = RecordingLRU(8)
    primary = PrimaryTier(region, 4096, policy)
    yield primary, policy
    primary.shutdown()


def test_stores_loads_and_touches_are_reported_as_chains(recorded: tuple[PrimaryTier, RecordingLRU]) -> None:
    tier, policy = recorded
    fill(tier, 1, 2)
    assert policy.chains == [([k(1), k(2)], [tier.slot_of(k(1)), tier.slot_of(k(2))], -1, False)]
    policy.chains.clear()
    result = tier.prepare_store([k(2), k(3), k(3), k(4)], after=k(1))  # 2 is held, 3 is given twice
    assert result is not None and result.keys_to_store == [k(3), k(4)]
    slots = [tier.slot_of(x) for x in (k(2), k(3), k(4))]
    assert policy.chains == [([k(2), k(3), k(4)], slots, tier.slot_of(k(1)), False)], "after the inserts"
    tier.complete_store(result.keys_to_store)
    policy.chains.clear()
    tier.prepare_load([k(1), k(2)])
    tier.complete_load([k(1), k(2)])
    assert policy.chains == [([k(1), k(2)], [tier.slot_of(k(1)), tier.slot_of(k(2))], -1, True)]
    policy.chains.clear()
    tier.prepare_write([k(5)])  # a promotion is referenced when it is loaded, not when reserved
    assert policy.chains == []
    tier.touch([k(1), k(2), k(5), k(9), k(3), k(4)])  # 5 is in flight, 9 unknown: three runs
    assert [(c[0], c[2]) for c in policy.chains] == [
        ([k(1), k(2)], -1),
        ([k(3), k(4)], -1),
    ]


def test_touch_runs_after_an_in_flight_block_name_it_as_parent(recorded: tuple[PrimaryTier, RecordingLRU]) -> None:
    tier, policy = recorded
    fill(tier, 1)
    assert tier.prepare_store([k(2)]) is not None  # 2 in flight
    fill(tier, 3)
    policy.chains.clear()
    tier.touch([k(1), k(2), k(3)])
    assert [(c[0], c[2]) for c in policy.chains] == [([k(1)], -1), ([k(3)], tier.slot_of(k(2)))]


def test_chains_are_released_tail_first_so_lru_keeps_the_head(recorded: tuple[PrimaryTier, RecordingLRU]) -> None:
    tier, _ = recorded
    fill(tier, 1, 2, 3)
    tier.prepare_load([k(1), k(2), k(3)])
    tier.complete_load([k(1), k(2), k(3)])
    result = tier.prepare_store([k(i) for i in range(4, 10)])  # 6 new blocks into 5 free rows
    assert result is not None and result.evicted_keys == [k(3)], "the tail goes first, the head stays"
    assert tier.complete_store(result.keys_to_store) == result.keys_to_store, "completion order is kept"


def test_a_load_is_a_use_for_arc(private_shm: Path) -> None:
    """Regression: loads only pinned and unpinned, so ARC never saw a second use (no block reached T2)."""
    region = SharedRegion("primary-arc", 4, 4096, shm_dir=private_shm)
    tier = PrimaryTier(region, 4096, "arc")
    try:
        fill(tier, 1, 2)
        tier.prepare_load([k(1)])
        tier.complete_load([k(1)])
        policy = tier.policy
        assert isinstance(policy, ARCPolicy) and (policy.t1, policy.t2) == (1, 1)
        result = tier.prepare_store([k(3), k(4), k(5)])  # one eviction: T1's block, not the loaded one
        assert result is not None and result.evicted_keys == [k(2)]
    finally:
        tier.shutdown()


def test_a_device_store_completes_pinned_for_its_cascades_and_never_a_promotion(tier: PrimaryTier) -> None:
    assert tier.prepare_store([k(1), k(2)]) is not None
    assert tier.prepare_write([k(3)]) is not None  # a promotion in flight
    done, slots = tier.complete_device_store([k(1), k(3), k(2), k(9)], pins=2)
    assert done == [k(1), k(2)] and slots == [tier.slot_of(k(1)), tier.slot_of(k(2))]
    assert [tier.ref_count(x) for x in (k(1), k(2), k(3))] == [2, 2, -1]
    assert tier.policy.evictable_count() == 0, "pinned at once: not evictable in between"
    assert tier.complete_device_store([k(1)], pins=2) == ([], []), "completed once only"
    tier.unpin([k(1), k(2)])
    assert tier.policy.evictable_count() == 0
    tier.unpin([k(1), k(2)])
    assert tier.policy.evictable_count() == 2 and tier.lookup(k(1)) is LookupResult.HIT
    assert tier.prepare_store([k(4)]) is not None
    row = tier.slot_of(k(4))
    assert tier.complete_device_store([k(4)], success=False, pins=2) == ([k(4)], [row])
    assert tier.ref_count(k(4)) is None, "a failed store is removed, never pinned"
    assert tier.complete_write([k(3)]) == [k(3)], "the promotion completes through its own path"


def test_unpin_slots_has_the_effect_of_unpin(private_shm: Path) -> None:
    """Releasing a cascade's pins by the rows it holds (no index lookup) equals unpin by key: the
    same ref counts, the same ignored extra release, the same eviction order after."""
    regions = [SharedRegion(f"primary-unpin-{i}", 5, 4096, shm_dir=private_shm) for i in range(2)]
    tiers = [PrimaryTier(region, 4096, "lru") for region in regions]
    by_key, by_slot = tiers
    try:
        for tier in tiers:
            fill(tier, 1, 2, 3, 4, 5)
        keys = [k(4), k(1), k(3)]
        by_key.pin_slots(keys, 2)
        slots = by_slot.pin_slots(keys, 2)
        for _ in range(3):  # the third release of each block is logged and ignored
            by_key.unpin(keys)
            by_slot.unpin_slots(keys, slots)
            assert [by_key.ref_count(x) for x in keys] == [by_slot.ref_count(x) for x in keys]
        assert [by_slot.ref_count(x) for x in keys] == [0, 0, 0]
        evicted = []
        for tier in tiers:
            result = tier.prepare_store([k(i) for i in range(10, 15)])
            assert result is not None
            evicted.append(result.evicted_keys)
        assert evicted[0] == evicted[1] and evicted[1][-3:] == [k(3), k(1), k(4)], "released tail first"
    finally:
        for tier in tiers:
            tier.shutdown()


def test_a_tier_that_records_no_events_behaves_the_same_without_them(private_shm: Path) -> None:
    """record_events=False: stores, evictions, promotions and a reset leave no event (an engine
    that never takes them must not pay for them) and change nothing else."""
    regions = [SharedRegion(f"primary-events-{i}", 2, 4096, shm_dir=private_shm) for i in range(2)]
    quiet, recording = PrimaryTier(regions[0], 4096, "lru", record_events=False), PrimaryTier(regions[1], 4096, "lru")
    try:
        for tier in (quiet, recording):
            fill(tier, 1, 2)
            result = tier.prepare_store([k(3)])  # evicts 2 (completed first, so least recent)
            assert result is not None and result.evicted_keys == [k(2)]
            tier.complete_store(result.keys_to_store)
            assert tier.reserve_one(k(4)) is not None  # evicts 1
            tier.complete_write([k(4)])
            tier.reset()
        assert quiet.take_events() == []
        assert len(recording.take_events()) == 6
        assert quiet.stats == recording.stats
    finally:
        quiet.shutdown()
        recording.shutdown()
