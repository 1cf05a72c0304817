"""Shared pieces of the per-policy test modules.

``Slotted`` drives a policy the way the primary tier does: each new key takes
a free row slot, every later call names it, and removal or eviction frees it.

``ProtocolMachine`` drives an eviction policy through exactly the call order
the primary tier uses (insert -> mark_evictable / mark_pinned ... -> remove or
eviction) and compares every ``evict`` answer with a naive reference model of
the same policy, written with plain lists so that it is obviously right. Each
test module subclasses it with its policy and its reference.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Container, Iterable
from typing import Generic, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.keys import BlockKey
from kvtier.policies.base import EvictionPolicy

NUM_KEYS = 10


def key(i: int) -> BlockKey:
    """A 32-byte block key for small integer ``i``."""
    return i.to_bytes(32, "big")


class ScanSpy(Container[BlockKey]):
    """A ``protected`` set that records every key the policy asks it about."""

    def __init__(self, keys: Iterable[BlockKey] = ()) -> None:
        self.keys = set(keys)
        self.asked: list[BlockKey] = []

    def __contains__(self, item: object) -> bool:
        assert isinstance(item, bytes)
        self.asked.append(item)
        return item in self.keys


P = TypeVar("P", bound=EvictionPolicy)


class Slotted(Generic[P]):
    """A policy with the primary tier's slot bookkeeping, called by key.

    ``insert`` gives a new key a free slot (the ``pick``-th free one, so tests can
    vary which), the other calls pass the key's slot, and ``remove`` and
    ``evict`` free the slots again. ``touch`` and ``remove`` of an unknown key
    name a free slot, which the policy must ignore.
    """

    def __init__(self, policy: P) -> None:
        self.policy = policy
        self.slot_of: dict[BlockKey, int] = {}
        self.free = list(range(policy.capacity - 1, -1, -1))

    def _slot_or_free(self, k: BlockKey) -> int:
        slot = self.slot_of.get(k)
        if slot is None:
            assert self.free, "an unknown key can only name a free slot"
            return self.free[-1]
        return slot

    def insert(self, k: BlockKey, pick: int = 0) -> None:
        assert k not in self.slot_of, "a key is inserted once"
        assert self.free, "no free slot: the tier evicts before it inserts"
        slot = self.free.pop(len(self.free) - 1 - pick % len(self.free))
        self.slot_of[k] = slot
        self.policy.insert(k, slot)

    def remove(self, k: BlockKey) -> None:
        slot = self._slot_or_free(k)
        self.policy.remove(k, slot)
        if self.slot_of.pop(k, None) is not None:
            self.free.append(slot)

    def touch(self, k: BlockKey) -> None:
        self.policy.touch(k, self._slot_or_free(k))

    def reference_chain(self, keys: list[BlockKey], parent: BlockKey | None = None, hit: bool = True) -> None:
        """Report resident ``keys`` as one request's chain, after ``parent`` (resident or None)."""
        up = -1 if parent is None else self.slot_of[parent]
        self.policy.reference_chain(keys, [self.slot_of[k] for k in keys], up, hit)

    def mark_evictable(self, k: BlockKey) -> None:
        self.policy.mark_evictable(k, self.slot_of[k])

    def mark_pinned(self, k: BlockKey) -> None:
        self.policy.mark_pinned(k, self.slot_of[k])

    def evict(self, n: int, protected: Container[BlockKey] = ()) -> list[BlockKey] | None:
        chosen = self.policy.evict(n, protected)
        for k in chosen or ():
            assert k in self.slot_of, "evicted a key that is not resident"
            self.free.append(self.slot_of.pop(k))
        return chosen

    def clear(self) -> None:
        self.policy.clear()
        self.slot_of.clear()
        self.free = list(range(self.policy.capacity - 1, -1, -1))

    def evictable_count(self) -> int:
        return self.policy.evictable_count()


class KeyState(enum.Enum):
    ABSENT = "absent"
    NEW = "new"  # inserted, write in flight: not evictable
    EVICTABLE = "evictable"
    PINNED = "pinned"


class ReferencePolicy:
    """The interface of a naive reference model (EvictionPolicy's calls, by key only)."""

    def insert(self, k: BlockKey) -> None:
        raise NotImplementedError

    def remove(self, k: BlockKey) -> None:
        raise NotImplementedError

    def touch(self, k: BlockKey) -> None:
        raise NotImplementedError

    def mark_evictable(self, k: BlockKey) -> None:
        raise NotImplementedError

    def mark_pinned(self, k: BlockKey) -> None:
        raise NotImplementedError

    def evict(self, n: int, protected: set[BlockKey]) -> list[BlockKey] | None:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError


class ProtocolMachine(RuleBasedStateMachine):
    """Random interleavings of the primary tier's calls, checked against a reference."""

    capacity = 4
    make_policy: Callable[[int], EvictionPolicy]
    make_reference: Callable[[int], ReferencePolicy]

    def __init__(self) -> None:
        super().__init__()
        self.tier = Slotted(type(self).make_policy(self.capacity))
        self.policy = self.tier.policy
        self.ref = type(self).make_reference(self.capacity)
        self.state = {key(i): KeyState.ABSENT for i in range(NUM_KEYS)}

    def _keys_in(self, *states: KeyState) -> list[BlockKey]:
        return [k for k, s in self.state.items() if s in states]

    # --- the primary tier's calls, in its order ---------------------------------------

    @rule(i=st.integers(0, NUM_KEYS - 1), pick=st.integers(0, 3))
    def insert(self, i: int, pick: int) -> None:
        k = key(i)
        if self.state[k] is not KeyState.ABSENT or not self.tier.free:
            return  # the tier evicts before it inserts into a full tier
        self.tier.insert(k, pick)
        self.ref.insert(k)
        self.state[k] = KeyState.NEW

    @rule(i=st.integers(0, NUM_KEYS - 1))
    def complete(self, i: int) -> None:
        k = key(i)
        if self.state[k] is not KeyState.NEW:
            return
        self.tier.mark_evictable(k)
        self.ref.mark_evictable(k)
        self.state[k] = KeyState.EVICTABLE

    @rule(i=st.integers(0, NUM_KEYS - 1))
    def remove(self, i: int) -> None:
        k = key(i)
        if self.state[k] is KeyState.ABSENT:
            return
        self.tier.remove(k)
        self.ref.remove(k)
        self.state[k] = KeyState.ABSENT

    @rule(i=st.integers(0, NUM_KEYS - 1))
    def pin(self, i: int) -> None:
        k = key(i)
        if self.state[k] is not KeyState.EVICTABLE:
            return
        self.tier.mark_pinned(k)
        self.ref.mark_pinned(k)
        self.state[k] = KeyState.PINNED

    @rule(i=st.integers(0, NUM_KEYS - 1))
    def unpin(self, i: int) -> None:
        k = key(i)
        if self.state[k] is not KeyState.PINNED:
            return
        self.tier.mark_evictable(k)
        self.ref.mark_evictable(k)
        self.state[k] = KeyState.EVICTABLE

    @rule(i=st.integers(0, NUM_KEYS - 1))
    def touch(self, i: int) -> None:
        # The primary tier forwards touches of ready blocks (evictable or pinned) only;
        # absent keys are included too (naming a free slot), which a policy must ignore.
        k = key(i)
        if self.state[k] is KeyState.NEW or (self.state[k] is KeyState.ABSENT and not self.tier.free):
            return
        self.tier.touch(k)
        self.ref.touch(k)

    @rule(n=st.integers(0, 4), protected=st.sets(st.integers(0, NUM_KEYS - 1), max_size=4))
    def evict(self, n: int, protected: set[int]) -> None:
        spy = ScanSpy(key(i) for i in protected)
        before = self.policy.evictable_count()
        chosen = self.tier.evict(n, spy)
        expected = self.ref.evict(n, spy.keys)
        assert chosen == expected
        not_evictable = set(self._keys_in(KeyState.NEW, KeyState.PINNED))
        assert not not_evictable.intersection(spy.asked), "evict scanned a pinned or in-flight key"
        if chosen is None:
            assert self.policy.evictable_count() == before
            return
        assert len(chosen) == n == len(set(chosen))
        for k in chosen:
            assert self.state[k] is KeyState.EVICTABLE
            assert k not in spy.keys
            self.state[k] = KeyState.ABSENT
        assert self.policy.evictable_count() == before - n

    @precondition(lambda self: any(s is not KeyState.ABSENT for s in self.state.values()))
    @rule()
    def clear(self) -> None:
        self.tier.clear()
        self.ref.clear()
        self.state = dict.fromkeys(self.state, KeyState.ABSENT)

    @invariant()
    def evictable_count_matches(self) -> None:
        assert self.policy.evictable_count() == len(self._keys_in(KeyState.EVICTABLE))
        assert set(self.tier.slot_of) == set(self._keys_in(KeyState.NEW, KeyState.EVICTABLE, KeyState.PINNED))
