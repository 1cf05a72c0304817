"""Where the fleet index keeps, for every block key, the set of locations that hold it.

A location is a small integer (a bit): an engine's device cache, one of its private
tiers, or a shared store. A key's value is the bitmask of its locations, so the
longest cached prefix of a prompt is one read per block. Two stores with one
interface:

* :class:`MemoryMasks`: in this process (one ``kvtier fleet serve`` answering routers);
* :class:`RedisMasks`: in Redis, for several routers sharing one index: one writer (the
  process that subscribes to the engines) and any number of readers. Layout under a
  prefix ``P``: ``P:k:<key hex>`` a bitmap of the key's locations (``SETBIT``/``GETRANGE``);
  ``P:l:<bit>`` the set of keys of a location (so a location is cleared without a scan; a key
  leaves it only in the script that clears its bit); ``P:meta`` the index's engine and location
  table (JSON, written by the writer); ``P:wiping`` there while the index is being deleted;
  ``P:writer`` the writer's claim (a random token with a time to live, refreshed while it
  writes, and taken again if it ran out with nobody else holding it, e.g. after Redis
  restarted empty; the index under the prefix is then deleted, as it is when the Redis
  server changes under the claim: a restart from an older save, a failover): a second writer
  on the same prefix is refused, and a writer that takes the prefix over first deletes the
  index a previous writer left there (its location bits need not match the new writer's).
  A deletion deletes the table first and ``P:wiping`` last, so one that failed midway (a link
  cut, a writer killed, a save taken meanwhile) is finished by the next one.
  Every write, deletions included, is fenced by the claim (a Lua script checks the token and
  writes, atomically): a writer that lost its claim writes nothing more. Every command has the
  client's socket timeout.

  The prefix should be private to the index (Redis ACLs: ``~P:*`` read-write for the
  writer, read-only for routers). Still, nothing read back is trusted: a reader reads at
  most the bytes of the locations its engine table names, a set member that is not a key
  is skipped, a table that is not JSON or is too large reads as empty, and a writer deletes
  only keys of an index's shapes, and only where an index's table (or ``P:wiping``) is, or
  where it wrote its own index.

Callers: the writer from its subscriber thread, readers from request threads; both
implementations are safe for that (the memory one under its own lock).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from kvtier.errors import KvtierError

logger = logging.getLogger(__name__)

MAX_LOCATIONS = 1 << 16
"""The most location bits an index allocates (a key's bitmap is at most 8 KiB)."""

MAX_META_BYTES = 16 << 20
"""A larger engine table read from Redis is refused (reads as empty)."""

CLEAR_CHUNK = 8192
"""Keys whose masks :meth:`MemoryMasks.clear` changes under one hold of its lock (about a millisecond)."""

_MAX_KEY_HEX = 24  # a key is at most 96 bits (a 32-bit group above a 64-bit hash)


class WriterConflict(KvtierError):
    """Another writer holds the Redis prefix (or took it over from this one)."""


class ClaimLapsed(KvtierError):
    """The writer's claim ran out with nobody else holding it: a write was refused until it is taken again."""


class IndexFull(KvtierError):
    """An in-memory index holds ``max_keys`` keys: a change that would add more is refused."""


class StoreUnavailable(KvtierError):
    """The index's store (Redis) did not answer a read."""


class LocationMasks(Protocol):
    """The key -> location bitmask store (see the module docstring)."""

    def add(self, bit: int, keys: Iterable[int]) -> None: ...

    def remove(self, bit: int, keys: Iterable[int]) -> None: ...

    def clear(self, bit: int) -> None:
        """Remove ``bit`` from every key that has it."""

    def masks(self, keys: Sequence[int], bits: int = MAX_LOCATIONS) -> list[int]:
        """The bitmask of each key (0: nowhere); only locations below ``bits`` need be read."""

    def count(self, bit: int) -> int:
        """How many keys have ``bit``."""

    def members(self, bit: int) -> set[int]:
        """The keys that have ``bit`` (tests, snapshots of small locations)."""

    def put_meta(self, meta: dict[str, Any]) -> None: ...

    def get_meta(self) -> dict[str, Any]: ...

    def open_writer(self) -> None:
        """Called once by the writer before its first write (claims a shared store)."""

    def keep_writer(self) -> bool:
        """Called by the writer every few seconds while it runs (keeps its claim). True when the
        claim had lapsed with nobody else holding it and was taken again: what the writer wrote
        may be gone (a Redis restarted empty)."""

    def close_writer(self) -> None:
        """Called by the writer when it stops (releases its claim)."""

    def write_failure(self) -> tuple[float, str] | None:
        """Since when (``time.monotonic()``) every write to the store has failed, and why the last
        one did; None while the last write went through (or none failed). Read from any thread."""

    def claim_failure(self) -> str | None:
        """Why the writer does not hold its claim on a shared store now (a fenced write found it
        had run out; or :meth:`keep_writer` found it had, or Redis changed under it, and has not
        yet deleted the index under the prefix), or None while it does. Read from any thread."""

    def evicting(self) -> str | None:
        """Why the shared store may drop the index's keys on its own (a Redis whose ``maxmemory``
        policy evicts keys without a time to live), as the writer last found (when it claimed the
        store, then every few seconds), or None. Read from any thread."""

    def writer_missing(self) -> str | None:
        """Why no writer keeps the index now (a shared store's claim is gone: the writer stopped,
        or stopped renewing it), or None while one does: a reader asks it, as what it reads no
        longer follows the engines. May block on the store (its client's timeout); raises
        :class:`StoreUnavailable` where it does not answer. Any thread."""


class MemoryMasks:
    """:class:`LocationMasks` in this process's memory: at most ``max_keys`` entries, an entry
    being a key in one location (a key in one location costs about 200 bytes, each further
    location of it about 80); an :meth:`add` that would hold more adds nothing and raises
    :class:`IndexFull` (the index skips the rest of the batch and marks its engine partial)."""

    def __init__(self, max_keys: int = 1 << 24) -> None:
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._masks: dict[int, int] = {}
        self._members: dict[int, set[int]] = {}
        self._entries = 0  # (key, location) pairs: the sizes of the _members sets together
        self._meta: dict[str, Any] = {}
        self._clearing = 0  # the bits of locations being cleared: no answer shows them

    def add(self, bit: int, keys: Iterable[int]) -> None:
        flag = 1 << bit
        keys = list(keys)
        with self._lock:
            masks = self._masks
            members = self._members.setdefault(bit, set())
            new = set(keys).difference(members)
            if self._entries + len(new) > self.max_keys:
                raise IndexFull(f"the fleet index holds {self._entries} entries (a key in a location); {len(new)} "
                                f"more would pass max_keys ({self.max_keys})")  # fmt: skip
            for key in new:
                masks[key] = masks.get(key, 0) | flag
            members.update(new)
            self._entries += len(new)

    def remove(self, bit: int, keys: Iterable[int]) -> None:
        with self._lock:
            members = self._members.get(bit)
            if members:
                self._drop(bit, [k for k in set(keys) if k in members], members)

    def clear(self, bit: int) -> None:
        """Empty location ``bit``: at once for readers (the bit is hidden from :meth:`masks`), then
        its keys' masks :data:`CLEAR_CHUNK` keys at a time, the lock let go between chunks, so
        answers never wait for a large location's whole clear (about 0.1 s per million keys).
        The writer's thread; the bit is not reused before this returns."""
        flag = 1 << bit
        with self._lock:
            members = self._members.pop(bit, None)
            if not members:
                return
            self._entries -= len(members)
            self._clearing |= flag
        keys = list(members)
        start = 0
        try:
            for start in range(0, len(keys), CLEAR_CHUNK):
                with self._lock:
                    self._unmask(bit, keys[start : start + CLEAR_CHUNK])
        except BaseException:  # (no memory): the keys not cleared stay listed, so a later clear finds them
            with self._lock:
                left = keys[start:]
                self._members.setdefault(bit, set()).update(left)
                self._entries += len(left)
            raise
        finally:
            with self._lock:
                self._clearing &= ~flag

    def _drop(self, bit: int, keys: list[int], members: set[int]) -> None:
        self._entries -= len(keys)  # (every key given is one of the location's)
        members.difference_update(keys)
        self._unmask(bit, keys)

    def _unmask(self, bit: int, keys: list[int]) -> None:
        """Take ``bit`` out of the masks of ``keys`` (a key left in no location is forgotten).
        Caller holds the lock."""
        keep = ~(1 << bit)
        masks = self._masks
        for key in keys:
            mask = masks.get(key, 0) & keep
            if mask:
                masks[key] = mask
            else:
                masks.pop(key, None)

    def masks(self, keys: Sequence[int], bits: int = MAX_LOCATIONS) -> list[int]:
        get = self._masks.get
        with self._lock:
            if self._clearing:
                shown = ~self._clearing
                return [get(key, 0) & shown for key in keys]
            return [get(key, 0) for key in keys]

    def count(self, bit: int) -> int:
        with self._lock:
            return len(self._members.get(bit, ()))

    def members(self, bit: int) -> set[int]:
        with self._lock:
            return set(self._members.get(bit, ()))

    def put_meta(self, meta: dict[str, Any]) -> None:
        with self._lock:
            self._meta = meta

    def get_meta(self) -> dict[str, Any]:
        with self._lock:
            return self._meta

    def open_writer(self) -> None:
        pass

    def keep_writer(self) -> bool:
        return False

    def close_writer(self) -> None:
        pass

    def write_failure(self) -> tuple[float, str] | None:
        return None  # (a full index refuses a change, IndexFull: the store itself does not fail)

    def claim_failure(self) -> str | None:
        return None

    def evicting(self) -> str | None:
        return None

    def writer_missing(self) -> str | None:
        return None  # (in memory: the writer is this process)

    def __len__(self) -> int:
        return len(self._masks)


class RedisMasks:
    """:class:`LocationMasks` in Redis (see the module docstring); ``client`` is a redis-py
    client (its socket timeout bounds every call). Writes go out as one pipeline per call.
    ``writer_ttl``: seconds the writer's claim lives unrefreshed (a writer killed -9 holds
    the prefix that long); ``claim_wait``: how long :meth:`open_writer` waits for another
    writer's claim to end before refusing."""

    _CLEAR_BATCH = 1000
    # The claim is refreshed or released only while it is still this writer's (atomic); a claim
    # nobody holds (it ran out while Redis was down, or Redis restarted empty) is taken again.
    _KEEP = ("local held = redis.call('get', KEYS[1]) "
             "if held == ARGV[1] then redis.call('expire', KEYS[1], ARGV[2]) return 1 end "
             "if not held then redis.call('set', KEYS[1], ARGV[1], 'EX', ARGV[2]) return 2 end return 0")  # fmt: skip
    _RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
    # Every write is fenced by the claim: it runs only while ``P:writer`` still holds this writer's
    # token, in one script (atomic), so a writer that lost its claim (paused past its TTL while
    # another took the prefix over) cannot write one more byte into the other writer's index.
    # KEYS: the claim, the location's key set, the key bitmaps; ARGV: token, bit, 0/1, set members.
    # A script answers -1 where another writer holds the claim, -2 where nobody does (it ran out).
    _FENCE = ("local held = redis.call('get', KEYS[1]) "
              "if held ~= ARGV[1] then if held then return -1 end return -2 end ")
    # Every key is checked before the first write (a script stopped by an error keeps what it
    # wrote): a foreign type under the prefix refuses the whole chunk of an add, so no bit is set
    # that the location's set does not list (clear() could never find it). A removal skips such a
    # key (it holds no bit of the index's) and still clears the others' bits: one planted key must
    # not leave the chunk's other keys claimed after an engine dropped them.
    _SET_BITS = (_FENCE +
                 "local bit, value = tonumber(ARGV[2]), tonumber(ARGV[3]) "
                 "local st = redis.call('type', KEYS[2])['ok'] "
                 "if value == 1 then "
                 "  if st ~= 'none' and st ~= 'set' then "
                 "    return redis.error_reply('WRONGTYPE ' .. KEYS[2] .. ' is not a set') end "
                 "  for i = 3, #KEYS do local t = redis.call('type', KEYS[i])['ok'] "
                 "    if t ~= 'none' and t ~= 'string' then "
                 "      return redis.error_reply('WRONGTYPE ' .. KEYS[i] .. ' is not a bitmap') end end "
                 "end "
                 "for i = 3, #KEYS do "
                 "  if value == 1 then redis.call('setbit', KEYS[i], bit, 1) "
                 "  elseif redis.call('type', KEYS[i])['ok'] == 'string' "
                 "         and redis.call('getbit', KEYS[i], bit) == 1 then "
                 "    redis.call('setbit', KEYS[i], bit, 0) "
                 "    if redis.call('bitcount', KEYS[i]) == 0 then redis.call('del', KEYS[i]) end "
                 "  end "
                 "end "
                 "if value == 1 then for i = 4, #ARGV do redis.call('sadd', KEYS[2], ARGV[i]) end "
                 "elseif st == 'set' then for i = 4, #ARGV do redis.call('srem', KEYS[2], ARGV[i]) end end "
                 "return 1")  # fmt: skip
    # A location is cleared by reading some of its keys (SRANDMEMBER, no change) and then, in one
    # script, clearing their bits and removing them from its set: a reply lost on the way loses
    # nothing (the script ran whole or not at all; a retry finds the keys still listed, or gone
    # with their bits). KEYS: the claim, the location's key set, the key bitmaps; ARGV: token, bit,
    # set members (those that are not a key's hex have no bitmap: they are only removed).
    _CLEAR_SOME = (_FENCE +
                   "local bit = tonumber(ARGV[2]) "
                   "for i = 3, #KEYS do "
                   "  if redis.call('type', KEYS[i])['ok'] == 'string' "
                   "     and redis.call('getbit', KEYS[i], bit) == 1 then "
                   "    redis.call('setbit', KEYS[i], bit, 0) "
                   "    if redis.call('bitcount', KEYS[i]) == 0 then redis.call('del', KEYS[i]) end "
                   "  end "
                   "end "
                   "for i = 3, #ARGV do redis.call('srem', KEYS[2], ARGV[i]) end return 1")  # fmt: skip
    # The index's deletion, fenced like every write: the marker ``P:wiping`` is set (and the table
    # deleted, so readers see no engines) first, the bitmaps and key sets go in batches, the marker
    # last; a deletion left unfinished (a writer that died or failed midway, Redis restarted from a
    # save taken meanwhile) is finished by the next writer. KEYS: the claim, then what to set/delete.
    _WIPING = _FENCE + "redis.call('set', KEYS[2], ARGV[1]) redis.call('del', KEYS[3]) return 1"
    _DELETE = _FENCE + "for i = 2, #KEYS do redis.call('del', KEYS[i]) end return 1"
    _PUT = _FENCE + "redis.call('set', KEYS[2], ARGV[2]) return 1"
    # The claim's lease renewed in the middle of a long deletion or clear (no tick runs meanwhile):
    # fenced like a write, so only this writer's own claim is renewed. ARGV: token, seconds.
    _RENEW = _FENCE + "redis.call('expire', KEYS[1], ARGV[2]) return 1"
    _WRITE_CHUNK = 500  # keys per fenced script call (one pipeline holds them all)

    def __init__(
        self, client: Any, prefix: str = "kvtier-fleet", *, writer_ttl: int = 15, claim_wait: float = 0.0
    ) -> None:
        if not prefix or len(prefix) > 200 or any(c.isspace() or c in "*?[]\\" for c in prefix):
            raise ValueError(f"Redis prefix must be 1-200 characters without whitespace or *?[]\\, got {prefix!r:.80}")
        if isinstance(writer_ttl, bool) or not isinstance(writer_ttl, int) or writer_ttl < 1:
            raise ValueError(f"writer_ttl must be an integer >= 1 (seconds), got {writer_ttl!r}")
        self.client = client
        self.prefix = prefix
        self.writer_ttl = writer_ttl
        self.claim_wait = claim_wait
        self._token: str | None = None
        self._lost = False  # the claim was lost: every write is refused (another writer owns the prefix)
        self._writer_key = f"{prefix}:writer"
        self._wiping_key = f"{prefix}:wiping"  # set while the index under the prefix is being deleted
        self._server: str | None = None  # the Redis server's run_id when the claim was taken (None: not known)
        self._rebuild = False  # this writer's index under the prefix is to be deleted (a failed deletion is retried)
        self._failing: tuple[float, str] | None = None  # since when every write failed, why the last did
        self._unclaimed: str | None = None  # why the claim is not held (see claim_failure)
        self._evicts: str | None = None  # why Redis may evict the index's keys (see evicting)

    # --- the writer's claim ---------------------------------------------------------------

    def open_writer(self) -> None:
        """Claim the prefix for this writer (waiting up to ``claim_wait`` seconds for another
        writer's claim to end), then delete the index a previous writer left under it; raises
        :class:`WriterConflict` if another writer holds it, or another kvtier version's index is
        there (its table's ``version`` is not 1: neither deleted nor written into). Where it waits, one warning says so
        at once (the claim's time left, how long it waits), before the wait. Where the deletion
        fails (Redis, a foreign key of another type under the index's names), the claim is given
        back before the error is raised: no writer runs, and one started again must not wait out
        this one's lease (a deletion left midway is finished by the next writer)."""
        token = os.urandom(12).hex()
        deadline = time.monotonic() + self.claim_wait
        warned = False
        while not self.client.set(self._writer_key, token, nx=True, ex=self.writer_ttl):
            if time.monotonic() >= deadline:
                ends = self._claim_end()
                if ends is None:  # (it ended just now: take it)
                    continue
                raise WriterConflict(
                    f"another kvtier fleet writer holds the Redis prefix {self.prefix!r} ({ends}): "
                    "stop it, wait, or give this index another --redis-prefix"
                )
            if not warned:
                ends = self._claim_end()
                warned = ends is not None
                if warned:
                    logger.warning("fleet: another kvtier fleet writer holds the Redis prefix %r (%s): waiting up to "
                                   "%g s for its claim to end", self.prefix, ends, self.claim_wait)  # fmt: skip
            time.sleep(0.5)
        self._token = token
        try:
            self._server = self._run_id()
            self._evicts = self._eviction()
            self._wipe("a previous writer left", ours=False)
        except BaseException:  # (no writer runs on it: a writer started again must not wait out its lease)
            with contextlib.suppress(Exception):
                self.close_writer()
            self._token = None
            raise

    def _claim_end(self) -> str | None:
        """When another writer's claim on the prefix ends, in words (its time to live); None where
        it has just ended (nobody holds the prefix now)."""
        left = self.client.ttl(self._writer_key)
        if left == -2:
            return None
        if left < 0:  # (-1: set by hand, without a time to live)
            return f"its claim {self._writer_key!r} has no time to live: delete it if no writer runs"
        return f"its claim ends within {left} s if it is gone"

    def _info(self, section: str) -> dict[str, Any]:
        """``INFO section`` as a dict; empty where the client may not ask (an ACL without
        ``INFO``) or the reply is not one. Raises where Redis fails."""
        try:
            info = self.client.info(section)
        except Exception as exc:
            if type(exc).__name__ in ("ResponseError", "NoPermissionError", "AuthorizationError"):
                return {}
            raise
        return info if isinstance(info, dict) else {}

    def _run_id(self) -> str | None:
        """The Redis server's ``run_id`` (new with each start of redis-server, and another server's
        after a failover); None where the client may not ask (an ACL without ``INFO``)."""
        run_id = self._info("server").get("run_id")
        return str(run_id) if run_id is not None else None

    def _eviction(self) -> str | None:
        """Why the Redis server may evict the index's keys, which have no time to live: a
        ``maxmemory`` with an ``allkeys-*`` policy (an evicted location's key set would leave bits
        behind that no clear finds: answers would claim blocks engines dropped); None where it may
        not, or where the client may not ask (an ACL without ``INFO``). Logs a warning when found."""
        info = self._info("memory")
        policy, limit = str(info.get("maxmemory_policy", "")), info.get("maxmemory", 0)
        if not policy.startswith("allkeys-") or not isinstance(limit, int) or limit <= 0:
            return None
        why = (f"the index's Redis evicts keys without a time to live (maxmemory-policy {policy:.40}, maxmemory "
               f"{limit}): an evicted key of the index would leave answers claiming blocks engines dropped; give "
               "the index a Redis whose maxmemory-policy is noeviction or volatile-*")  # fmt: skip
        if self._evicts is None:
            logger.warning("fleet: %s (Redis prefix %r); answers are refused (503) until it no longer does", why,
                           self.prefix)  # fmt: skip
        return why

    def _wipe(self, whose: str, *, ours: bool) -> None:
        """Delete the index under the prefix: its keys of an index's shapes, where ``ours`` (this
        writer's own index), where an index's table is, or where a deletion was left unfinished
        (``P:wiping``); else nothing (what is under the prefix is not an index's). Every deletion
        is fenced by the claim (raises :class:`WriterConflict` / :class:`ClaimLapsed` as writes
        do, having deleted nothing of another writer's); the table goes first (readers see no
        engines from then on), the marker last, so a deletion that failed midway is finished by
        the next call, or by the next writer."""
        token = self._check_writer()
        if not ours and not self.client.exists(self._wiping_key):
            table = self.get_meta()
            if _is_other_index(table):  # (its bitmaps would be read, and written, as this index's)
                raise WriterConflict(f"the Redis prefix {self.prefix!r} holds the index of another kvtier version "
                                     f"(its engine table's version is {table.get('version')!r:.40}, this kvtier "
                                     f"writes version 1): stop that writer and delete its index, or give this index "
                                     "another --redis-prefix")  # fmt: skip
            if not _is_fleet_table(table):
                return  # no index here: whatever else is under the prefix is not ours to delete
        meta = f"{self.prefix}:meta"
        self._fenced_eval(self._WIPING, [self._wiping_key, meta], token)
        stale = 0
        renewed = time.monotonic()
        for batch in self._index_keys():
            renewed = self._renew_if_due(token, renewed)
            self._delete(batch, token)
            stale += len(batch)
        self._delete([self._wiping_key.encode()], token)
        if stale:
            logger.info("fleet: deleted %d key(s) %s under Redis prefix %r", stale, whose, self.prefix)

    def _renew_if_due(self, token: str, renewed: float) -> float:
        """Renew the claim's lease where a third of it passed since ``renewed`` (in a deletion or a
        clear of millions of keys, which outlasts the lease: it ran out midway before, and the writer
        refused to start, or rebuilt the whole index, with Redis answering all along); returns when
        it was last renewed. Raises as a write does where the claim is no longer this writer's."""
        now = time.monotonic()
        if now - renewed < self.writer_ttl / 3:
            return renewed
        self._fenced_eval(self._RENEW, [], token, self.writer_ttl)
        return now

    def _delete(self, names: list[bytes], token: str) -> None:
        """Delete ``names``, fenced by the claim (one script)."""
        self._fenced_eval(self._DELETE, names, token)

    def _fenced_eval(self, script: str, keys: Sequence[str | bytes], *args: Any) -> None:
        """Run one fenced ``script`` (its first key the claim, then ``keys``; its first argument
        the token, then ``args``) as one write; raises as :meth:`_fenced` does."""
        self._fenced([self._write(lambda: self.client.eval(script, 1 + len(keys), self._writer_key, *keys, *args))])

    def _index_keys(self) -> Iterator[list[bytes]]:
        """The names of an index's keys under the prefix (key bitmaps, location sets, the table), in
        batches (not the marker ``P:wiping``)."""
        # Only names the index writes: no leading zero, a location below MAX_LOCATIONS.
        shapes = rb":(k:%s|l:(?P<at>0|[1-9][0-9]{0,4})|meta)" % _KEY_HEX.pattern
        ours = re.compile(re.escape(self.prefix).encode() + shapes)
        batch: list[bytes] = []
        for name in self.client.scan_iter(match=f"{self.prefix}:*", count=self._CLEAR_BATCH):
            raw = name if isinstance(name, bytes) else str(name).encode()
            if (shape := ours.fullmatch(raw)) and not (shape["at"] and int(shape["at"]) >= MAX_LOCATIONS):
                batch.append(raw)
            if len(batch) >= self._CLEAR_BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    def keep_writer(self) -> bool:
        """Refresh the claim, or take it again if nobody holds it; raises :class:`WriterConflict`
        if another writer holds it. True where what is under the prefix can no longer be trusted,
        and was deleted: the claim had run out (another writer may have written there meanwhile,
        or Redis restarted from an older save), or the Redis server is not the one the claim was
        taken on (a restart, which may have loaded an older RDB/AOF with this very claim in it, or
        a failover to a replica that lagged), or it no longer evicts the index's keys after it did
        (:meth:`evicting`: what it evicted meanwhile is not known)."""
        if self._token is None:
            return False
        kept = self._write(lambda: self.client.eval(self._KEEP, 1, self._writer_key, self._token, self.writer_ttl))
        if not kept:
            self._token = None
            self._lost = True
            raise WriterConflict(f"the fleet writer lost its claim on the Redis prefix {self.prefix!r} to another "
                                 "writer: it no longer writes there (stop one of them)")  # fmt: skip
        if kept == 2:  # a rebuild found due is due (and /health 503) until done, whatever fails next (INFO)
            logger.warning("fleet: the writer's claim on Redis prefix %r had run out (Redis restarted, or did not "
                           "answer for %d s); nobody else held it, so it was taken again and the index under it "
                           "is rebuilt", self.prefix, self.writer_ttl)  # fmt: skip
            self._rebuild = True
            self._unclaimed = self._unclaimed or "the claim ran out and was taken again; the index is not rebuilt yet"
        server = self._run_id() if self._server is not None else None
        if server is not None and server != self._server:
            if kept != 2:
                logger.warning("fleet: the Redis server of prefix %r changed (run_id %s -> %s: a restart or a "
                               "failover, maybe from an older save); the index under it is rebuilt", self.prefix,
                               self._server, server)  # fmt: skip
            self._server = server
            self._rebuild = True
            self._unclaimed = self._unclaimed or "Redis changed under the claim; the index is not rebuilt yet"
        evicts = self._eviction()
        if evicts is None and self._evicts is not None:  # (what it evicted meanwhile is unknown: rebuilt)
            logger.warning("fleet: the Redis of prefix %r no longer evicts the index's keys; the index under it is "
                           "rebuilt", self.prefix)  # fmt: skip
            self._rebuild = True  # (and untrusted, as after a restart, until the deletion went through)
            self._unclaimed = self._unclaimed or "its Redis evicted the index's keys; the index is not rebuilt yet"
        self._evicts = evicts
        if self._rebuild:  # (until the deletion went through: a Redis error midway is retried next time)
            self._wipe("written before the claim ran out or Redis restarted", ours=True)
            self._rebuild = False
            self._unclaimed = None
            return True
        self._unclaimed = None
        return False

    def close_writer(self) -> None:
        if self._token is not None:
            self.client.eval(self._RELEASE, 1, self._writer_key, self._token)
            self._token = None

    # --- keys ---------------------------------------------------------------------------

    def _key(self, key: int) -> str:
        return f"{self.prefix}:k:{key:x}"

    def _set(self, bit: int) -> str:
        return f"{self.prefix}:l:{bit}"

    def add(self, bit: int, keys: Iterable[int]) -> None:
        self._set_bit(bit, list(keys), 1)

    def remove(self, bit: int, keys: Iterable[int]) -> None:
        self._set_bit(bit, list(keys), 0)  # (a key bitmap left with no bit is deleted in the same script)

    def _check_writer(self) -> str:
        """This writer's token; raises :class:`WriterConflict` once the claim was lost."""
        if self._lost or self._token is None:
            raise WriterConflict(f"the fleet writer lost its claim on the Redis prefix {self.prefix!r} to another "
                                 "writer: it no longer writes there (stop one of them)")  # fmt: skip
        return self._token

    def _fenced(self, results: Iterable[Any]) -> None:
        """Raise where a fenced script refused to write: :class:`WriterConflict` (and no write
        from now on) where another writer holds the claim, :class:`ClaimLapsed` where nobody
        does (:meth:`keep_writer` takes it again)."""
        refusals = {r for r in results if type(r) is int and r < 0}
        if -1 in refusals:
            self._token = None
            self._lost = True
            self._check_writer()
        if refusals:
            self._unclaimed = self._unclaimed or "a write found the claim had run out"
            raise ClaimLapsed(f"the fleet writer's claim on the Redis prefix {self.prefix!r} ran out (Redis restarted, "
                              "or did not answer for a while): nothing is written until it is taken again")  # fmt: skip

    def _set_bit(self, bit: int, keys: list[int], value: int) -> None:
        """Set (1) or clear (0) ``bit`` of every key's bitmap and update the location's key set
        (clearing deletes a bitmap left with no bit): one pipeline of fenced scripts."""
        token = self._check_writer()
        if not keys:
            return
        pipe = self.client.pipeline(transaction=False)
        for at in range(0, len(keys), self._WRITE_CHUNK):
            chunk = keys[at : at + self._WRITE_CHUNK]
            names = [self._key(k) for k in chunk]
            pipe.eval(self._SET_BITS, 2 + len(names), self._writer_key, self._set(bit), *names, token, bit, value,
                      *[f"{k:x}" for k in chunk])  # fmt: skip
        self._fenced(self._write(pipe.execute))

    def clear(self, bit: int) -> None:
        """Remove ``bit`` from every key of the location, some keys at a time: each batch is read
        from the location's set without a change, then its bits cleared and its keys removed from
        the set in one fenced script (a key leaves the set only with its bit cleared, so a failure
        or a lost reply at any point leaves nothing behind that a retry cannot find)."""
        token = self._check_writer()
        name = self._set(bit)
        renewed = time.monotonic()
        while True:
            renewed = self._renew_if_due(token, renewed)
            members = self._write(lambda: self.client.srandmember(name, self._CLEAR_BATCH))
            if not members:
                break
            keys = [self._key(k) for k in _parse_keys(members)]
            self._fenced_eval(self._CLEAR_SOME, [name, *keys], token, bit, *members)

    def masks(self, keys: Sequence[int], bits: int = MAX_LOCATIONS) -> list[int]:
        if not keys:
            return []
        last_byte = (max(1, min(bits, MAX_LOCATIONS)) - 1) // 8
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.getrange(self._key(key), 0, last_byte)  # only the bytes of locations that matter
        return [_bitmap_mask(value) for value in self._read("the key bitmaps", pipe.execute)]

    def _write(self, call: Callable[[], Any]) -> Any:
        """``call()``, one of the writer's round trips to Redis, its outcome kept for
        :meth:`write_failure` (a write Redis answered counts as through, even one the claim's
        fence refused: Redis answers, and the claim is the fence's business: :meth:`claim_failure`).
        A failure dates from when its call began (a timeout counts from when the write was sent)."""
        began = time.monotonic()
        try:
            done = call()
        except Exception as exc:  # redis.RedisError, OSError: whatever the client raises
            since = self._failing[0] if self._failing is not None else began
            self._failing = (since, f"{type(exc).__name__}: {exc}"[:200])
            raise
        self._failing = None
        return done

    def write_failure(self) -> tuple[float, str] | None:
        return self._failing

    def claim_failure(self) -> str | None:
        return self._unclaimed

    def evicting(self) -> str | None:
        return self._evicts

    def _read(self, what: str, call: Any) -> Any:
        """``call()``; any failure of Redis (or of the way there) as :class:`StoreUnavailable` naming it."""
        try:
            return call()
        except Exception as exc:  # redis.RedisError, OSError: whatever the client raises
            # (an error reply, NOPERM from an ACL say, is an answer: a refusal)
            refused = any(c.__name__ == "ResponseError" for c in type(exc).__mro__)  # (redis-py's, not imported here)
            verb = "refused the read" if refused else "did not answer"
            raise StoreUnavailable(f"the index's Redis {verb} (reading {what} under prefix {self.prefix!r}): "
                                   f"{type(exc).__name__}: {exc}") from exc  # fmt: skip

    def count(self, bit: int) -> int:
        return int(self.client.scard(self._set(bit)))

    def members(self, bit: int) -> set[int]:
        return set(_parse_keys(self.client.smembers(self._set(bit))))

    def put_meta(self, meta: dict[str, Any]) -> None:
        token = self._check_writer()
        table = json.dumps(meta, separators=(",", ":"))
        self._fenced_eval(self._PUT, [f"{self.prefix}:meta"], token, table)

    def writer_missing(self) -> str | None:
        # GETRANGE, as the table is read: a router's ACL that allows that allows this (no EXISTS)
        claimed = self._read("the writer's claim", lambda: self.client.getrange(self._writer_key, 0, 0))
        if claimed:  # (a claim is a non-empty token)
            return None
        return (f"no fleet writer keeps the index under Redis prefix {self.prefix!r}: its lease "
                f"{self._writer_key!r} is gone (the writer stopped, or was killed or cut off from Redis over "
                "its lease's time ago), so the index no longer follows the engines: start the writer "
                "(kvtier fleet serve --redis URL without --read-only)")  # fmt: skip

    def get_meta(self) -> dict[str, Any]:
        """The engine table, or {} where there is none or it is not a (strict) JSON object of at
        most :data:`MAX_META_BYTES` (a reader checks each entry: :func:`kvtier.fleet.index.checked_meta`).
        ``NaN`` and ``Infinity`` are not JSON: such a table, which no writer writes, is ignored like any
        other (an answer quoting one could not be sent: every request was a 500)."""
        raw = self._read("the engine table", lambda: self.client.getrange(f"{self.prefix}:meta", 0, MAX_META_BYTES))
        if not raw:
            return {}
        if len(raw) > MAX_META_BYTES:
            logger.warning("fleet: the engine table under Redis prefix %r is over %d bytes; ignored", self.prefix,
                           MAX_META_BYTES)  # fmt: skip
            return {}
        try:
            meta = json.loads(raw, parse_constant=_not_json)
        except (ValueError, RecursionError):
            logger.warning("fleet: the engine table under Redis prefix %r is not JSON; ignored", self.prefix)
            return {}
        return meta if isinstance(meta, dict) else {}


def _not_json(constant: str) -> Any:
    """``json.loads``' hook for ``NaN``, ``Infinity`` and ``-Infinity``: refused (strict JSON)."""
    raise ValueError(f"{constant} is not JSON")


_KEY_HEX = re.compile(rb"(0|[1-9a-f][0-9a-f]{0,%d})" % (_MAX_KEY_HEX - 1))
"""A key's hex as the index writes it (``f"{key:x}"``: no leading zero), so no other name matches."""


def _is_fleet_table(meta: dict[str, Any]) -> bool:
    return meta.get("version") == 1 and isinstance(meta.get("engines"), dict)


def _is_other_index(meta: dict[str, Any]) -> bool:
    """An engine table of another layout than this kvtier's (a ``version`` other than 1 beside an
    ``engines`` object): another kvtier version's index, whose bits need not mean this one's."""
    return isinstance(meta.get("engines"), dict) and "version" in meta and not _is_fleet_table(meta)


def _parse_keys(members: Iterable[bytes | str]) -> list[int]:
    """The keys of a location's set; a member that is not a key's hex (not written by the
    index) is skipped."""
    keys = []
    for member in members:
        raw = member if isinstance(member, bytes) else member.encode()
        if _KEY_HEX.fullmatch(raw):
            keys.append(int(raw, 16))
    return keys


# Each byte with its bits in reverse order: a Redis bitmap's offset 0 is its first byte's high bit.
_REVERSED = bytes(int(f"{b:08b}"[::-1], 2) for b in range(256))


def _bitmap_mask(value: bytes | None) -> int:
    """A Redis bitmap (bit 0 is the first byte's high bit) as an integer with bit i = offset i."""
    if not value:
        return 0
    return int.from_bytes(value.translate(_REVERSED), "little")
