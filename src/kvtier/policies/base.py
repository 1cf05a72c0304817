"""The eviction-policy contract used by the CPU primary tier.

The primary tier owns ref counts and the rows; a policy only orders blocks. The
tier tells the policy when a block becomes evictable (ref count 0) and when it
stops being evictable (pinned or in flight), so ``evict`` only ever visits
evictable blocks: pinned blocks are never scanned.

Every call names a block by its key and by its row ``slot`` (``0 <= slot <
capacity``), so a policy can keep its per-block state in arrays indexed by
slot instead of hash tables keyed by block (hash tables grow to several times
their entries under the delete/insert churn of a running engine). A slot holds
one block from ``insert`` until ``remove`` or eviction, then the tier reuses it
for another key. The slot objects passed are the tier's own ints, the same
object for a slot every time, so a policy may store them without allocating.

Call order per block: ``insert(key, slot)`` (new block, not yet evictable) ->
``mark_evictable`` / ``mark_pinned`` any number of times -> ``remove`` or
eviction. ``touch`` is a recency hint and may come for pinned blocks and for
blocks still being written. ``touch`` and ``remove`` naming a slot that holds
no block must be ignored. All calls come from the owning tier's thread (the
scheduler thread for the CPU tier). The key and slot sequences passed belong to
the caller: a policy reads them during the call and keeps none of them.

Prefix structure: keys are chained prefix hashes, so a block can only be hit
while every block before it in its request is held too. The tier reports each
request's blocks in prefix order through :meth:`reference_chain` (a load of a
hit prefix, a store of the blocks that missed, a touch), naming the block that
precedes the first one when it knows it. A policy may use this to evict leaves
before their parents and to protect a chain's head at least as long as its
tail; the default treats it as touches, tail first, so the head ends most
recent.

Batched forms: the tier reports runs of blocks through :meth:`insert_many`,
:meth:`mark_evictable_many`, :meth:`mark_pinned_many` and
:meth:`mark_evictable_then_pinned_many`. Each must have exactly
the effect of the per-block call on every pair, in the order given; the defaults
are those loops. A policy may specialise them to save a Python call per block
(the built-in LRU does); a subclass of such a policy that overrides a per-block
method must override its batched form too. :meth:`evict_one` is ``evict(1)`` in a
form a policy may specialise the same way (LRU's defers to a subclass's ``evict``).

Any tier that evicts can drive a policy: it needs a key -> slot map over a
fixed number of slots (the CPU tier's rows; a disk tier with fixed-size value
files could number its entries the same way), calls ``insert`` / ``remove`` as
entries come and go, ``mark_pinned`` / ``mark_evictable`` around reads, and
``evict`` to make room.

Out-of-tree policies subclass :class:`EvictionPolicy` (constructor
``cls(capacity)``) and are named by import path ``"package.module:Class"``.
"""

from __future__ import annotations

import abc
from collections.abc import Container, Mapping, Sequence
from typing import ClassVar

from kvtier.keys import BlockKey


class EvictionPolicy(abc.ABC):
    """Orders the evictable blocks of a tier and picks which to evict; subclass it for your own policy.

    One invariant: :meth:`evict` returns only blocks that are evictable now (inserted,
    marked evictable since their last :meth:`mark_pinned`, not removed or evicted) and not
    in ``protected``, and forgets them. The owning tier keeps the ref counts and rows; it
    tells the policy about each block through its row ``slot`` (``0 <= slot < capacity``):
    ``insert`` -> ``mark_evictable`` / ``mark_pinned`` any number of times -> ``remove`` or
    eviction; ``touch`` and :meth:`reference_chain` are recency hints. Every call comes from
    the tier's one thread (the scheduler thread for the CPU tier) and must not block; key
    and slot sequences passed are the caller's, read during the call and never kept.

    To write one: subclass, set ``name``, implement :meth:`insert`, :meth:`remove`,
    :meth:`touch`, :meth:`mark_evictable`, :meth:`mark_pinned`, :meth:`evict`, :meth:`clear`
    and :meth:`evictable_count`, and keep the constructor ``cls(capacity)``; then name it
    as ``policy: "package.module:Class"``. The batched forms (``insert_many``,
    ``mark_evictable_many``, ...) default to loops over the per-block calls. The full
    contract is in :mod:`kvtier.policies.base`.
    """

    name: ClassVar[str] = "abstract"

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"policy capacity must be positive, got {capacity}")
        self.capacity = capacity

    @abc.abstractmethod
    def insert(self, key: BlockKey, slot: int) -> None:
        """A new block was allocated in ``slot`` (not evictable until ``mark_evictable``)."""

    @abc.abstractmethod
    def remove(self, key: BlockKey, slot: int) -> None:
        """The block was removed by the tier (not an eviction); ``slot`` is free again."""

    @abc.abstractmethod
    def touch(self, key: BlockKey, slot: int) -> None:
        """The block was used (recency)."""

    def reference_chain(self, keys: Sequence[BlockKey], slots: Sequence[int], parent: int, hit: bool) -> None:
        """One request referenced these blocks (all held by the tier), in prefix order.

        The block in ``slots[i]`` extends the one in ``slots[i - 1]``, and
        ``slots[0]`` extends the block in slot ``parent`` (-1: unknown or none).
        ``hit``: the tier is serving them (a load or a touch); False: the request
        missed them here and they are being stored (those inserted since their
        last reference are new; the others were held but unreachable). Comes
        after ``insert`` of the new blocks; the blocks may be evictable, pinned
        or still being written.

        The default touches each block, the tail first, so the head of the chain
        ends the most recently used.
        """
        for i in range(len(slots) - 1, -1, -1):
            self.touch(keys[i], slots[i])

    def continue_chain(self, keys: Sequence[BlockKey], slots: Sequence[int], parent: int) -> None:
        """A store that continues the same request's previous store, whose tail is in slot ``parent``.

        Engines store a request in pieces (a prefill in chunks, then each
        decoded block), so one request may reach the policy as several stored
        chains; this call says that the chain extends the request's last one,
        for a policy that classifies whole requests. Same arguments and timing
        as a store's :meth:`reference_chain` (``hit`` False, ``parent`` >= 0),
        which the default calls.
        """
        self.reference_chain(keys, slots, parent, False)

    def end_request(self, tail_slot: int) -> None:
        """The request whose last store ended in slot ``tail_slot`` finished: no store continues it.

        Called when the engine finishes a request that stored blocks (the tier's
        thread, after the request's stores; the slot still holds that block), so
        a policy that keeps state per open request (see :meth:`continue_chain`)
        can let it go. The default does nothing.
        """
        return

    def hint_request(
        self, tail_slot: int, session: str | None, session_end: bool, expected_return_s: float | None
    ) -> None:
        """The application's hints about the request whose last store ended in ``tail_slot``: its
        conversation's id (None: not said), whether the conversation ended with it, and in how many
        seconds its next request is expected (None: not said); bounded and well formed (see
        :mod:`kvtier.request_control`).

        Called right after :meth:`end_request` for a request that carried hints (same
        thread, the slot still holds that block). The default ignores them (``lru``,
        ``arc``): hints may only change which blocks go first, never what is correct.
        """
        return

    @abc.abstractmethod
    def mark_evictable(self, key: BlockKey, slot: int) -> None:
        """The block's ref count became 0."""

    @abc.abstractmethod
    def mark_pinned(self, key: BlockKey, slot: int) -> None:
        """The block's ref count left 0 (a reader pinned it)."""

    def insert_many(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        """:meth:`insert` of ``keys[i]`` in ``slots[i]``, in order."""
        insert = self.insert
        for i in range(len(slots)):
            insert(keys[i], slots[i])

    def mark_evictable_many(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        """:meth:`mark_evictable` of each pair, in order."""
        mark = self.mark_evictable
        for i in range(len(slots)):
            mark(keys[i], slots[i])

    def mark_pinned_many(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        """:meth:`mark_pinned` of each pair, in order."""
        mark = self.mark_pinned
        for i in range(len(slots)):
            mark(keys[i], slots[i])

    def mark_evictable_then_pinned_many(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        """The blocks' writes completed and readers pinned them at once (a store cascaded to
        secondary tiers): :meth:`mark_evictable_many` then :meth:`mark_pinned_many`."""
        self.mark_evictable_many(keys, slots)
        self.mark_pinned_many(keys, slots)

    @abc.abstractmethod
    def evict(self, n: int, protected: Container[BlockKey] = ()) -> list[BlockKey] | None:
        """Choose and forget ``n`` evictable blocks whose keys are not in ``protected``.

        Returns their keys (the tier frees their slots). Atomic: returns None and
        changes nothing if fewer than ``n`` qualify.
        """

    def evict_one(self, protected: Container[BlockKey] = ()) -> BlockKey | None:
        """:meth:`evict` of one block: its key, or None (changing nothing) if none qualifies.
        The CPU tier calls it for each promotion's row; a policy may specialise it (the
        built-in LRU does), and must keep it equal to ``evict(1, protected)``."""
        chosen = self.evict(1, protected)
        return chosen[0] if chosen else None

    @abc.abstractmethod
    def clear(self) -> None:
        """Forget everything."""

    @abc.abstractmethod
    def evictable_count(self) -> int:
        """How many blocks could be evicted right now."""

    def relative_reuse(self, tail_slot: int, horizon: int) -> float | None:
        """How likely the blocks of the store that just ended in ``tail_slot`` are to be
        referenced again within ``horizon`` references, relative to the average stored block
        (1.0: as likely; 0.2: a fifth as likely), or None when the policy predicts nothing
        (a lower tier then takes every block). The manager's learned cascade admission asks it
        after each store (:mod:`kvtier.manager.admission`). Called from the tier's thread; O(1).
        The default predicts nothing."""
        return None

    def stats(self) -> Mapping[str, float | str]:
        """What the policy reports about itself (the manager's snapshot and metrics carry it):
        numbers, and under ``"state"`` a word for its state. Called from the tier's thread; cheap.
        The default reports nothing."""
        return {}
