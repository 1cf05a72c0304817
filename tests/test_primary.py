"""PrimaryTier bookkeeping: ref counts, eviction rules, events."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.errors import KvtierError
from kvtier.primary import PrimaryTier
from kvtier.region import SharedRegion
from kvtier.types import LookupResult

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
