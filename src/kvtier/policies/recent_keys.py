"""The fingerprints of the last N keys a policy recorded, in arrays allocated once.

:class:`~kvtier.policies.return_time.ReturnTimePolicy` records the end of every
request it sees, so that a conversation coming back is recognised even once
its blocks were evicted: which blocks of a request are genuinely new must not
depend on what the cache happened to keep, or the statistics learned from it
change whenever the holds do. The table must therefore cover many requests (a
quarter of the capacity) at a few bytes each: a Python set of ints costs about
80 bytes an entry and grows under churn, so this is a ring of ``capacity``
63-bit fingerprints (first in, first out) with an open-addressing index of
``2 ** k >= 2 * capacity`` cells (linear probing, backward-shift deletion), and
in front of it a filter of ``2 ** m >= 8 * capacity`` one-byte counters, one
per value of a fingerprint's low bits: 24 to 40 bytes an entry in all, whatever
the churn. Nearly every probe is a miss (a request's blocks are looked up from
its end, and most were never recorded); the filter answers most misses with
one byte read, where the index would walk a probe run (half full, most runs
are not empty) through the ring's fingerprints.

Fingerprints are those of :func:`~kvtier.policies.fingerprints.fingerprint` (the
key's cached hash): equal keys give equal fingerprints within one process. Two
keys share one with probability about 2**-63 a pair; a collision only makes a
new key look recorded. Not thread-safe: one owner thread.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kvtier.keys import BlockKey
from kvtier.policies.fingerprints import _MASK, unindex


class RecentKeys:
    """The last ``capacity`` distinct fingerprints added, with O(1) membership.

    Invariants: the index holds exactly the ring's live entries (``len(self)``
    of them, in ring positions ``0 .. len - 1`` before the ring first wraps),
    each fingerprint at most once.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"recent-key table capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._ring = array("q", bytes(8 * capacity))
        size = 4
        while size < 2 * capacity:
            size <<= 1
        self._index = array("i", bytes(4 * size))  # ring position + 1; 0: empty cell
        self._mask = size - 1
        self.filter = bytearray(4 * size)
        """Entries per value of the fingerprints' low bits (see :meth:`_count`); four times the
        index's cells, most 0. Read-only outside this class: ``filter[hash(key) & filter_mask]``
        is 0 for a key never recorded, the first probe of :meth:`deepest`, which a caller with
        one key may make itself to save the call."""
        self.filter_mask = 4 * size - 1
        self._pos = 0  # the ring position the next entry takes
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, fp: object) -> bool:
        return isinstance(fp, int) and self._find(fp) >= 0

    def add(self, fp: int) -> None:
        """Record ``fp`` (non-zero) unless present; the oldest entry goes when the table is full.

        Once per stored request, on the scheduler thread: :meth:`_find`'s filter read,
        :meth:`_unplace` and :meth:`_place` are inline (nearly every fingerprint added is new,
        and a call costs about as much as each of them)."""
        filt, fmask = self.filter, self.filter_mask
        if filt[fp & fmask] and self._find(fp) >= 0:
            return
        pos = self._pos
        ring, index, mask = self._ring, self._index, self._mask
        if self._len == self.capacity:  # _unplace(pos)
            unindex(index, ring, mask, pos)
            old = ring[pos]
            j = old & fmask  # _count(old, -1)
            if filt[j] < 255:
                filt[j] -= 1
            if old == 1 and filt[0] < 255:
                filt[0] -= 1
        else:
            self._len += 1
        ring[pos] = fp  # _place(pos, fp)
        j = fp & fmask
        if filt[j] < 255:
            filt[j] += 1
        if fp == 1 and filt[0] < 255:
            filt[0] += 1
        i = fp & mask
        while index[i]:
            i = (i + 1) & mask
        index[i] = pos + 1
        self._pos = pos + 1 if pos + 1 < self.capacity else 0

    def replace(self, old: int, new: int) -> None:
        """Record ``new`` in the place of ``old``: same age, so the table's order does not change.

        Keeps one entry for something recorded again and again (a request's end,
        which moves as the request is stored piece by piece). ``old`` no longer
        recorded: :meth:`add` of ``new``. ``new`` already recorded: nothing
        changes (``old`` ages out in its turn).
        """
        if old == new or self._find(new) >= 0:
            return
        pos = self._find(old)
        if pos < 0:
            self.add(new)
            return
        self._unplace(pos)
        self._place(pos, new)

    def deepest(self, keys: Sequence[BlockKey], low: int) -> int:
        """The largest ``i`` in ``low .. len(keys) - 1`` whose key is recorded, or -1.

        Scans from the end. Called per stored chain on the scheduler thread, so
        a miss costs as little as it can: one read of the filter at the key's
        low hash bits (those of its fingerprint; see :meth:`_count`); only a key
        the filter cannot rule out walks the index.
        """
        index, ring, mask = self._index, self._ring, self._mask
        filt, fmask = self.filter, self.filter_mask
        for pos in range(len(keys) - 1, low - 1, -1):
            if not filt[hash(keys[pos]) & fmask]:
                continue
            fp = hash(keys[pos]) & _MASK or 1
            i = fp & mask
            cell = index[i]
            while cell:
                if ring[cell - 1] == fp:
                    return pos
                i = (i + 1) & mask
                cell = index[i]
        return -1

    def clear(self) -> None:
        self.__init__(self.capacity)  # type: ignore[misc]

    # --- internals -------------------------------------------------------------------

    def _place(self, pos: int, fp: int) -> None:
        """Put ``fp`` at ring position ``pos`` (free, or just unplaced): ring, filter, index."""
        self._ring[pos] = fp
        self._count(fp, 1)
        index, mask = self._index, self._mask
        i = fp & mask
        while index[i]:
            i = (i + 1) & mask
        index[i] = pos + 1

    def _unplace(self, pos: int) -> None:
        """Take the entry at ring position ``pos`` out of the index and the filter."""
        unindex(self._index, self._ring, self._mask, pos)
        self._count(self._ring[pos], -1)

    def _count(self, fp: int, step: int) -> None:
        """Count ``fp`` in (step 1) or out of (step -1) the filter.

        A count stays once it reaches 255, so the filter never hides an entry.
        Fingerprint 1 is also the fingerprint of the keys whose hash has 63 low
        bits 0 (see :func:`~kvtier.policies.fingerprints.fingerprint`): their low
        hash bits are 0, so it counts in cell 0 as well as in its own.
        """
        filt = self.filter
        j = fp & self.filter_mask
        if filt[j] < 255:
            filt[j] += step
        if fp == 1 and filt[0] < 255:
            filt[0] += step

    def _find(self, fp: int) -> int:
        """The ring position of ``fp``, or -1 (at once if the filter rules it out)."""
        if not self.filter[fp & self.filter_mask]:
            return -1
        index, ring, mask = self._index, self._ring, self._mask
        i = fp & mask
        cell = index[i]
        while cell:
            if ring[cell - 1] == fp:
                return cell - 1
            i = (i + 1) & mask
            cell = index[i]
        return -1
