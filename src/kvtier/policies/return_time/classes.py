"""The hold classifier of ``return-time``: which class a reference is in, and how long it holds.

A reference's class comes from cheap features of its request (see
:func:`class_id`): how many of the request's blocks are genuinely new (bucket
of :func:`new_bucket`), whether the block is the request's last, and how many
times the block was referenced before while held (0, 1, 2+). "Genuinely new"
means after the deepest block that is held and was referenced before, or that
is the recorded end of one of the last requests: :class:`HoldClassifier` keeps
those ends in a :class:`~kvtier.policies.recent_keys.RecentKeys` table large
enough to cover the return times that matter, so a conversation that comes
back is recognised whether or not the cache kept its blocks, and the classes
(so the statistics learned per class) do not change when the holds do.

Each class holds its blocks for ``hold[class]`` references, from the plan the
model solved (:class:`~kvtier.policies.return_time.model.HoldingPlan`); the
plan's ``partial`` class holds a share ``fraction`` of its requests for
``extended`` instead, drawn once per request. Called from the policy's
thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.keys import BlockKey
from kvtier.policies.fingerprints import fingerprint
from kvtier.policies.recent_keys import RecentKeys
from kvtier.policies.return_time.model import HoldingPlan

NEW_BUCKETS = 4
"""Classes by genuinely new blocks in the request: <= 1, <= 3, <= 7, more."""

TOUCH_LEVELS = 3
"""Classes by references of the block before this one while held: 0, 1, 2 or more."""

CLASSES = NEW_BUCKETS * 2 * TOUCH_LEVELS
"""new-blocks bucket x last block or not x referenced 0 / 1 / 2+ times before."""

NEW_BUCKET_SPAN = 9
"""A request's blocks looked at from its end to count its new blocks: more than 7 new is the last bucket."""

_NEW_BUCKET = [0, 0, 1, 1, 2, 2, 2, 2, 3]
"""Bucket of ``min(new_blocks, 8)``."""


def class_id(bucket: int, last: bool, touches: int) -> int:
    """The class of a reference: new-blocks ``bucket``, the request's ``last`` block, ``touches`` (0-2).

    Classes are laid out so that ``class_id(b, last, t) == class_id(b, False, 0)
    + class_id(0, last, t)``: the hot paths add the two halves.
    """
    return (bucket * 2 + last) * TOUCH_LEVELS + touches


def touches_of(cls: int) -> int:
    """The ``touches`` feature of class ``cls``."""
    return cls % TOUCH_LEVELS


def new_bucket(new: int) -> int:
    """The bucket of a request with ``new`` genuinely new blocks."""
    return _NEW_BUCKET[new if new < 8 else 8]


LAST = class_id(0, True, 0)
"""What the request's last block adds to a class."""

BASE_OF_NEW = [class_id(new_bucket(new), False, 0) for new in range(NEW_BUCKET_SPAN)]
"""``class_id(new_bucket(new), False, 0)`` by ``min(new, 8)``: the class of a request's new
blocks but its last, looked up on the store path (two calls cost more than the block's work)."""


@dataclass(slots=True)
class OpenRequest:
    """A request whose blocks are held open until it is complete (see ``ReturnTimePolicy.continue_chain``).

    One per request, updated in place by each store that continues it (a
    decode stores a block at a time: a record built per store cost more than
    the block's own work).
    """

    tail_key: BlockKey
    """The key its last store ended with."""
    new: int
    """Its genuinely new blocks so far."""
    stored: int
    """Blocks it stored."""
    end: int
    """Fingerprint of its end (see :meth:`HoldClassifier.request_end`): its first store's, its
    last store's once it is complete."""
    published: int
    """The end in the table of request ends: its first store's until the request ends."""
    then: int
    """Clock of its last store."""
    opened: int
    """Expiry of its blocks while it is open: ``OPEN`` plus its first store's clock plus the longest
    hold (one int object, which all its open blocks share)."""
    held: int
    """The expiry its first store gave its blocks but the last (as if it ended then); -1 once they
    are open (:attr:`opened`: it stored more, or an eviction reached it)."""
    drawn: bool
    """Whether it drew the partial class's extended hold."""
    diff: int
    """Its guard difference so far."""
    sampled: list[int] | None = None
    """Fingerprints of its sampled blocks, in the order stored (None: none yet); while it has
    stored once, its first store's, kept for the opening of its blocks (see :attr:`watched`)."""
    watched: list[int] | None = None
    """While it has stored once: the guard's among :attr:`sampled`, in the order stored (None:
    none), which the guard's miniature opens with its blocks (``ReturnTimePolicy._open_request``)."""
    prefix: int = 3
    """The guard's prefix state (``guard.PREFIX_HITS`` until a sampled block misses)."""
    loaded: list[int] | None = None
    """Fingerprints of the sampled blocks of the prefix it loaded, head first (None: none)."""


class HoldClassifier:
    """Classes of references, the holds of the plan in use, and the table of request ends.

    ``ends``: how many request ends the table keeps. ``refs[c]`` counts the
    references of class ``c`` since :meth:`take_refs` (the model's rates).
    """

    def __init__(self, ends: int) -> None:
        self.history = RecentKeys(ends)
        self.hold: list[int] = [0] * CLASSES
        self.partial = -1
        self.extended = 0
        self.fraction = 0.0
        self._dither = 0.0
        self.refs = [0] * CLASSES
        self.learned: list[int] = [0] * CLASSES
        """The plan's holds, in use or not (what the guard's miniature of the learned holds uses)."""
        self._learned_partial = -1
        self._learned_extended = 0

    def use(self, plan: HoldingPlan | None, max_hold: int, in_use: bool = True) -> None:
        """Learn ``plan``'s holds (each at most ``max_hold``; None: every class 0, LRU order), and hold
        by them if ``in_use`` (else every class 0)."""
        if plan is None:
            self.learned, self._learned_partial, self._learned_extended = [0] * CLASSES, -1, 0
        else:
            self.learned = [min(h, max_hold) for h in plan.hold]
            self._learned_partial, self._learned_extended = plan.partial, min(plan.extended, max_hold)
        self.fraction = plan.fraction if plan is not None and in_use else 0.0
        if plan is None or not in_use:
            self.hold = [0] * CLASSES
            self.partial, self.extended = -1, 0
        else:
            self.hold = list(self.learned)
            self.partial, self.extended = plan.partial, self._learned_extended

    def learned_hold_of(self, cls: int, drawn: bool) -> int:
        """The plan's hold of class ``cls`` for a request that drew ``drawn``, in use or not."""
        if cls == self._learned_partial and drawn:
            return self._learned_extended
        return self.learned[cls]

    def take_refs(self) -> list[int]:
        """The references per class since the last call; the counts start again."""
        refs, self.refs = self.refs, [0] * CLASSES
        return refs

    def draw_extension(self) -> bool:
        """Whether this request takes the partial class's extended hold (a share ``fraction`` do).

        Drawn once per request: its tail's hold reaches its head anyway, so
        drawing per block would extend nearly every long request.
        """
        self._dither += self.fraction
        if self._dither >= 1.0:
            self._dither -= 1.0
            return True
        return False

    def extension_hold(self, drawn: bool) -> int:
        """The hold of the partial class for a request that drew ``drawn``."""
        return self.extended if drawn else self.hold[self.partial] if self.partial >= 0 else 0

    def hold_of(self, cls: int, drawn: bool) -> int:
        """The hold of class ``cls`` for a request that drew ``drawn``."""
        return self.extension_hold(drawn) if cls == self.partial else self.hold[cls]

    def new_blocks(self, keys: Sequence[BlockKey], slots: Sequence[int], touches: bytearray) -> int:
        """Blocks after the deepest one held and referenced before, or recorded as a request's end.

        ``slots`` empty: all the blocks are new here (only the recorded ends
        count). Looks ``NEW_BUCKET_SPAN`` blocks back at most.
        """
        n = len(keys)
        low = max(0, n - NEW_BUCKET_SPAN)
        found = self.history.deepest(keys, low)
        if slots:
            for i in range(n - 1, max(found, low - 1), -1):
                if touches[slots[i]]:
                    return n - 1 - i
        return n if found < 0 else n - 1 - found

    @staticmethod
    def request_end(keys: Sequence[BlockKey], before: BlockKey | None) -> int:
        """The fingerprint to record as the request's end, so its return is known even once
        its blocks are evicted: its last full block.

        That is the block before the last one (the last is usually partial, and a
        partial block is never referenced again); for a request of one block, the
        block it extends (``before``, if known). One entry per request, so the
        table covers as many requests as it has entries.
        """
        return fingerprint(keys[-2] if len(keys) >= 2 else before if before is not None else keys[-1])

    def publish(self, record: OpenRequest) -> None:
        """A request's end takes the place of its first store's in the table of request ends."""
        if record.end != record.published:
            self.history.replace(record.published, record.end)
