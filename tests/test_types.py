"""The public value types of kvtier.types."""

from __future__ import annotations

import dataclasses
import pickle

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
