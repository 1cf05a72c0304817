"""The batched policy calls (insert_many, mark_evictable_many, mark_pinned_many,
mark_evictable_then_pinned_many) have exactly the effect of the per-block calls in order, and
evict_one that of evict(1), for every built-in policy; LRU's own chain report is the base
class's (touches, tail first)."""

from __future__ import annotations

import random
from collections.abc import Container

import pytest

from kvtier.keys import BlockKey
from kvtier.policies import POLICIES, LRUPolicy
from kvtier.policies.base import EvictionPolicy

CAPACITY = 16


def key(i: int) -> BlockKey:
    return i.to_bytes(32, "big")


class PerBlock:
    """Drives a policy through per-block calls only (and the base class's chain report for LRU)."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy

    def insert_many(self, keys: list[BlockKey], slots: list[int]) -> None:
        for k, s in zip(keys, slots, strict=True):
            self.policy.insert(k, s)

    def mark_evictable_many(self, keys: list[BlockKey], slots: list[int]) -> None:
        for k, s in zip(keys, slots, strict=True):
            self.policy.mark_evictable(k, s)

    def mark_pinned_many(self, keys: list[BlockKey], slots: list[int]) -> None:
        for k, s in zip(keys, slots, strict=True):
            self.policy.mark_pinned(k, s)

    def mark_evictable_then_pinned_many(self, keys: list[BlockKey], slots: list[int]) -> None:
        self.mark_evictable_many(keys, slots)
        self.mark_pinned_many(keys, slots)

    def reference_chain(self, keys: list[BlockKey], slots: list[int], parent: int, hit: bool) -> None:
        if isinstance(self.policy, LRUPolicy):
            EvictionPolicy.reference_chain(self.policy, keys, slots, parent, hit)
        else:
            self.policy.reference_chain(keys, slots, parent, hit)


def _drive(name: str, seed: int) -> None:
    rng = random.Random(seed)
    batched, single = POLICIES[name](CAPACITY), POLICIES[name](CAPACITY)
    per_block = PerBlock(single)
    slot_of: dict[BlockKey, int] = {}
    state: dict[BlockKey, str] = {}  # "new" (in flight), "ready", "pinned"
    free = list(range(CAPACITY))
    next_key = 0
    for _ in range(300):
        op = rng.choice(["insert", "ready", "ready_pinned", "pin", "unpin", "chain", "evict", "remove"])
        if op == "insert" and free:
            n = rng.randint(1, min(4, len(free)))
            ks = [key(next_key + i) for i in range(n)]
            next_key += n
            slots = [free.pop(rng.randrange(len(free))) for _ in ks]
            slot_of.update(zip(ks, slots, strict=True))
            state.update(dict.fromkeys(ks, "new"))
            batched.insert_many(ks, slots)
            per_block.insert_many(ks, slots)
        elif op in ("ready", "ready_pinned", "pin", "unpin"):
            want = {"ready": "new", "ready_pinned": "new", "pin": "ready", "unpin": "pinned"}[op]
            pool = [k for k, s in state.items() if s == want]
            ks = rng.sample(pool, min(len(pool), rng.randint(1, 5)))
            slots = [slot_of[k] for k in ks]
            if op == "ready_pinned":
                batched.mark_evictable_then_pinned_many(ks, slots)
                per_block.mark_evictable_then_pinned_many(ks, slots)
                op = "pin"
            elif op == "pin":
                batched.mark_pinned_many(ks, slots)
                per_block.mark_pinned_many(ks, slots)
            else:
                batched.mark_evictable_many(ks, slots)
                per_block.mark_evictable_many(ks, slots)
            state.update(dict.fromkeys(ks, "pinned" if op == "pin" else "ready"))
        elif op == "chain" and slot_of:
            ks = rng.sample(sorted(slot_of), min(len(slot_of), rng.randint(1, 5)))
            slots = [slot_of[k] for k in ks]
            parent, hit = rng.choice([-1, *slot_of.values()]), rng.random() < 0.5
            batched.reference_chain(ks, slots, parent, hit)
            per_block.reference_chain(ks, slots, parent, hit)
        elif op == "evict":
            n = rng.randint(1, 3)
            protected = set(rng.sample(sorted(slot_of), min(len(slot_of), rng.randint(0, 3))))
            if n == 1 and rng.random() < 0.5:  # the single form
                one = batched.evict_one(protected)
                chosen = None if one is None else [one]
            else:
                chosen = batched.evict(n, protected)
            assert single.evict(n, protected) == chosen
            for k in chosen or ():
                free.append(slot_of.pop(k))
                del state[k]
        elif op == "remove" and slot_of:
            k = rng.choice(sorted(slot_of))
            batched.remove(k, slot_of[k])
            single.remove(k, slot_of[k])
            free.append(slot_of.pop(k))
            del state[k]
        assert batched.evictable_count() == single.evictable_count()
    count = batched.evictable_count()
    assert batched.evict(count) == single.evict(count), "the same order of every evictable block"


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("seed", range(20))
def test_batched_calls_are_the_per_block_calls_in_order(name: str, seed: int) -> None:
    _drive(name, seed)


def test_the_defaults_loop_over_the_per_block_calls() -> None:
    calls: list[tuple[str, BlockKey, int]] = []

    class Recording(LRUPolicy):
        def insert(self, key: BlockKey, slot: int) -> None:
            calls.append(("insert", key, slot))

        def mark_evictable(self, key: BlockKey, slot: int) -> None:
            calls.append(("evictable", key, slot))

        def mark_pinned(self, key: BlockKey, slot: int) -> None:
            calls.append(("pinned", key, slot))

    policy = Recording(4)
    ks = [key(1), key(2)]
    for method in (EvictionPolicy.insert_many, EvictionPolicy.mark_evictable_many, EvictionPolicy.mark_pinned_many):
        method(policy, ks, [3, 1])
    assert calls == [(c, k, s) for c in ("insert", "evictable", "pinned") for k, s in zip(ks, [3, 1], strict=True)]


def test_lru_evict_one_defers_to_a_subclass_that_chooses_differently() -> None:
    class NewestFirst(LRUPolicy):
        def evict(self, n: int, protected: Container[BlockKey] = ()) -> list[BlockKey] | None:
            keys = [k for k in reversed(self._key_of) if k and k not in protected][:n]
            for k in keys:
                self.remove(k, self._key_of.index(k))
            return keys if len(keys) == n else None

    for policy in (LRUPolicy(4), NewestFirst(4)):
        ks = [key(1), key(2), key(3)]
        policy.insert_many(ks, [0, 1, 2])
        policy.mark_evictable_many(ks, [0, 1, 2])
        expected = key(1) if type(policy) is LRUPolicy else key(3)
        assert policy.evict_one({key(9)}) == expected and policy.evictable_count() == 2
        assert policy.evict_one(set(ks)) is None and policy.evictable_count() == 2
