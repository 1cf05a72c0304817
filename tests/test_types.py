"""The public value types of kvtier.types."""

from __future__ import annotations

import dataclasses
import pickle
import re

import pytest

from kvtier.types import BlockEvent


def test_block_event_is_a_frozen_value() -> None:
    """BlockEvent's hand-written constructor (fields set through the instance dict, for speed)
    keeps every behaviour of the frozen dataclass it is."""
    event = BlockEvent((b"a", b"b"), "0:primary", "cpu", removed=True)
    assert (event.keys, event.tier, event.medium, event.removed) == ((b"a", b"b"), "0:primary", "cpu", True)
    same = BlockEvent(keys=(b"a", b"b"), tier="0:primary", medium="cpu", removed=True)
    assert event == same and hash(event) == hash(same) and len({event, same}) == 1
    assert event != dataclasses.replace(event, removed=False)
    assert dataclasses.replace(event, medium="disk").medium == "disk"
    assert dataclasses.asdict(event) == {"keys": (b"a", b"b"), "tier": "0:primary", "medium": "cpu", "removed": True,
                                         "time": 0.0}  # fmt: skip
    assert [f.name for f in dataclasses.fields(BlockEvent)] == ["keys", "tier", "medium", "removed", "time"]
    assert pickle.loads(pickle.dumps(event)) == event
    assert repr(event) == "BlockEvent(keys=(b'a', b'b'), tier='0:primary', medium='cpu', removed=True, time=0.0)"
    timed = BlockEvent((b"a", b"b"), "1:fs", "disk", False, 1700000000.25)
    assert timed.time == 1700000000.25 and timed != dataclasses.replace(timed, time=0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.removed = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        BlockEvent((b"a",), "0:primary", "cpu")  # type: ignore[call-arg]


def test_tier_label_names_the_cpu_tier_and_secondary_tiers() -> None:
    from kvtier import PRIMARY_LABEL, tier_label

    assert tier_label(0, "primary") == PRIMARY_LABEL == "0:primary"
    assert tier_label(2, "fs") == "2:fs"
    assert tier_label(1, "mypkg.tiers:MyTier") == "1:mypkg.tiers:MyTier"


@pytest.mark.parametrize(
    ("index", "tier_type", "fragment"),
    [
        (-1, "fs", "tier index -1 names no tier"),
        (True, "fs", "tier index True names no tier"),
        ("1", "fs", "tier index '1' names no tier"),
        (1.0, "fs", "tier index 1.0 names no tier"),
        (1, "", "tier type '' is empty"),
        (1, None, "tier type None is empty or not a string"),
        (1, "primary", "only it has that type"),
        (0, "fs", "index 0 is the CPU tier"),
    ],
)
def test_tier_label_refuses_what_names_no_tier(index: object, tier_type: object, fragment: str) -> None:
    """Regression (review, 2026-12-03): the exported ``kvtier.tier_label(-1, "fs")`` gave ``"-1:fs"``
    (also ``"True:fs"``, ``"1:primary"``, ``"1:"``); only ``TieringManager.tier_label`` was checked."""
    from kvtier import tier_label

    with pytest.raises(ValueError, match=re.escape(fragment)):
        tier_label(index, tier_type)  # type: ignore[arg-type]
