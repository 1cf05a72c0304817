"""Fixed-size tables of key fingerprints in preallocated arrays.

A policy that remembers keys it no longer holds (ARC's ghost lists, a sample
of recently seen keys, the ends of recent requests) must not keep the key
objects alive or grow hash tables under churn: a Python dict of evicted keys
costs about 150 bytes per entry once the key object is counted, and it grows
through deletions. :class:`FingerprintLists` stores a 63-bit fingerprint per
entry instead, in arrays allocated once for ``capacity`` entries (25-33 bytes
an entry in all), with an open-addressing index for membership.

Fingerprints come from Python's own (cached) hash of the key: equal keys give
equal fingerprints within one process, which is all an in-memory table needs.
Two different keys share a fingerprint with probability about 2**-63 per pair;
a collision only makes a policy treat a new key as one it has seen.

Entries live in ``lists`` independent lists (least recent first) that share
the one pool of ``capacity`` entries: ``_prev[e]`` / ``_next[e]`` link entry
``e`` through the list's sentinel ``capacity + list`` and ``_list_of[e]`` says
which list holds it (``FREE`` for a free entry). The index is a linear-probing
table of ``2 ** k >= 2 * capacity`` cells holding ``entry + 1`` (0: empty),
with backward-shift deletion, so lookups stay short under any churn.

Callers keep per-entry payloads in their own arrays indexed by entry number.
Not thread-safe: one owner thread (the policy's caller) at a time.
"""

from __future__ import annotations

from array import array

FREE = 255
"""``_list_of`` value of an entry that is in no list."""

_MASK = (1 << 63) - 1


def fingerprint(key: bytes) -> int:
    """A non-zero 63-bit fingerprint of ``key`` (stable within this process)."""
    return hash(key) & _MASK or 1


class FingerprintLists:
    """Up to ``capacity`` fingerprints in ``lists`` ordered lists, with O(1) membership.

    Invariants: every entry is either free or in exactly one list; the index
    holds exactly the entries in lists; ``len(self)`` counts them and
    ``count(list)`` counts each list's.
    """

    def __init__(self, capacity: int, lists: int = 1) -> None:
        if capacity <= 0:
            raise ValueError(f"fingerprint table capacity must be positive, got {capacity}")
        if not 1 <= lists < FREE:
            raise ValueError(f"lists must lie in 1..{FREE - 1}, got {lists}")
        self.capacity = capacity
        self.lists = lists
        self._fp = array("q", bytes(8 * capacity))
        ends = capacity + lists
        self._prev = array("i", range(ends))
        self._next = array("i", range(ends))
        self._list_of = bytearray([FREE]) * capacity
        self._counts = [0] * lists
        self._len = 0  # entries in the lists: the sum of _counts, kept (a miniature has 129 lists)
        size = 4
        while size < 2 * capacity:
            size <<= 1
        self._index = array("i", bytes(4 * size))
        self._mask = size - 1
        self._fresh = 0  # entries >= _fresh were never used
        self._free = -1  # head of the free entries, chained through _next

    def __len__(self) -> int:
        return self._len

    def count(self, which: int) -> int:
        return self._counts[which]

    def list_of(self, entry: int) -> int:
        return self._list_of[entry]

    def fingerprint_of(self, entry: int) -> int:
        return self._fp[entry]

    def find(self, fp: int) -> int:
        """The entry holding ``fp``, or -1."""
        index, fps, mask = self._index, self._fp, self._mask
        i = fp & mask
        while True:
            cell = index[i]
            if not cell:
                return -1
            if fps[cell - 1] == fp:
                return cell - 1
            i = (i + 1) & mask

    def fingerprints(self, which: int) -> list[int]:
        """The fingerprints of list ``which``, least recent first (O(n): for tests and reports)."""
        out: list[int] = []
        end = self.capacity + which
        entry = self._next[end]
        while entry != end:
            out.append(self._fp[entry])
            entry = self._next[entry]
        return out

    def head(self, which: int) -> int:
        """The least recent entry of list ``which``, or -1 if it is empty."""
        entry = self._next[self.capacity + which]
        return -1 if entry >= self.capacity else entry

    def add(self, fp: int, which: int) -> int:
        """Append ``fp`` (not present) as the most recent entry of ``which``; returns its entry.

        The pool must have room: callers pop or remove first (``len(self) < capacity``).
        """
        if self._free >= 0:
            entry = self._free
            self._free = self._next[entry]
        elif self._fresh < self.capacity:
            entry = self._fresh
            self._fresh += 1
        else:
            raise OverflowError(f"fingerprint table full ({self.capacity} entries)")
        self._fp[entry] = fp
        index, mask = self._index, self._mask
        i = fp & mask
        while index[i]:
            i = (i + 1) & mask
        index[i] = entry + 1
        self._link(entry, which)
        self._len += 1
        return entry

    def move_to_end(self, entry: int, which: int) -> None:
        """Make ``entry`` the most recent of list ``which`` (it may come from another list)."""
        prv, nxt, counts, list_of = self._prev, self._next, self._counts, self._list_of
        before, after = prv[entry], nxt[entry]
        nxt[before] = after
        prv[after] = before
        counts[list_of[entry]] -= 1
        end = self.capacity + which
        tail = prv[end]
        nxt[tail] = entry
        prv[entry] = tail
        nxt[entry] = end
        prv[end] = entry
        list_of[entry] = which
        counts[which] += 1

    def remove(self, entry: int) -> None:
        """Forget ``entry``: out of its list and the index; the entry is free again."""
        prv, nxt, list_of = self._prev, self._next, self._list_of  # out of its list, in place
        before, after = prv[entry], nxt[entry]
        nxt[before] = after
        prv[after] = before
        self._counts[list_of[entry]] -= 1
        list_of[entry] = FREE
        nxt[entry] = self._free
        self._free = entry
        self._len -= 1
        unindex(self._index, self._fp, self._mask, entry)

    def recycle(self, entry: int, fp: int, which: int) -> None:
        """:meth:`remove` ``entry``, then :meth:`add` ``fp`` to ``which``, which takes the same
        entry: fewer calls on the policies' sampled paths (a full table's every new key)."""
        index, fps, mask = self._index, self._fp, self._mask
        unindex(index, fps, mask, entry)
        fps[entry] = fp
        i = fp & mask
        while index[i]:
            i = (i + 1) & mask
        index[i] = entry + 1
        self.move_to_end(entry, which)

    def pop_head(self, which: int) -> int:
        """Remove the least recent entry of ``which``; returns its entry number (-1 if empty).

        The entry's payload stays readable until the next :meth:`add`.
        """
        entry = self.head(which)
        if entry >= 0:
            self.remove(entry)
        return entry

    def clear(self) -> None:
        self.__init__(self.capacity, self.lists)  # type: ignore[misc]

    # --- internals -------------------------------------------------------------------

    def _link(self, entry: int, which: int) -> None:
        end = self.capacity + which
        prv, nxt = self._prev, self._next
        tail = prv[end]
        nxt[tail] = entry
        prv[entry] = tail
        nxt[entry] = end
        prv[end] = entry
        self._list_of[entry] = which
        self._counts[which] += 1


def unindex(index: array[int], fps: array[int], mask: int, entry: int) -> None:
    """Take ``entry`` out of a linear-probing ``index`` of ``entry + 1`` cells (backward-shift deletion).

    ``fps[entry]`` is the entry's fingerprint, whose low bits (``& mask``) are
    its home cell; the entry must be in the index. Shared by the fingerprint
    tables of this package.
    """
    i = fps[entry] & mask
    while index[i] != entry + 1:
        i = (i + 1) & mask
    # Backward-shift deletion: pull later cells of the probe run into the hole.
    j = i
    while True:
        j = (j + 1) & mask
        cell = index[j]
        if not cell:
            break
        home = fps[cell - 1] & mask
        # The cell may move to the hole i unless its home lies cyclically in (i, j].
        if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
            index[i] = cell
            i = j
    index[i] = 0
