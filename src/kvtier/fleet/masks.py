"""Where the fleet index keeps, for every block key, the set of locations that hold it.

A location is a small integer (a bit): an engine's device cache, one of its private
tiers, or a shared store. A key's value is the bitmask of its locations, so the
longest cached prefix of a prompt is one read per block. Two stores with one
interface:

* :class:`MemoryMasks`: in this process (one ``kvtier fleet serve`` answering routers);
* :class:`RedisMasks`: in Redis, for several routers sharing one index: one writer (the
  process that subscribes to the engines) and any number of readers. Layout under a
  prefix ``P``: ``P:k:<key hex>`` a bitmap of the key's locations (``SETBIT``/``GETRANGE``);
  ``P:l:<bit>`` the set of keys of a location (so a location is cleared without a scan);
  ``P:meta`` the index's engine and location table (JSON, written by the writer).
  Every command has the client's socket timeout.

Callers: the writer from its subscriber thread, readers from request threads; both
implementations are safe for that (the memory one under its own lock).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Protocol


class LocationMasks(Protocol):
    """The key -> location bitmask store (see the module docstring)."""

    def add(self, bit: int, keys: Iterable[int]) -> None: ...

    def remove(self, bit: int, keys: Iterable[int]) -> None: ...

    def clear(self, bit: int) -> None:
        """Remove ``bit`` from every key that has it."""

    def masks(self, keys: Sequence[int]) -> list[int]:
        """The bitmask of each key (0: nowhere)."""

    def count(self, bit: int) -> int:
        """How many keys have ``bit``."""

    def members(self, bit: int) -> set[int]:
        """The keys that have ``bit`` (tests, snapshots of small locations)."""

    def put_meta(self, meta: dict[str, Any]) -> None: ...

    def get_meta(self) -> dict[str, Any]: ...


class MemoryMasks:
    """:class:`LocationMasks` in this process's memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._masks: dict[int, int] = {}
        self._members: dict[int, set[int]] = {}
        self._meta: dict[str, Any] = {}

    def add(self, bit: int, keys: Iterable[int]) -> None:
        flag = 1 << bit
        with self._lock:
            masks = self._masks
            members = self._members.setdefault(bit, set())
            for key in keys:
                masks[key] = masks.get(key, 0) | flag
                members.add(key)

    def remove(self, bit: int, keys: Iterable[int]) -> None:
        with self._lock:
            members = self._members.get(bit)
            if members:
                self._drop(bit, [k for k in keys if k in members], members)

    def clear(self, bit: int) -> None:
        with self._lock:
            members = self._members.pop(bit, None)
            if members:
                self._drop(bit, list(members), set())

    def _drop(self, bit: int, keys: list[int], members: set[int]) -> None:
        keep = ~(1 << bit)
        masks = self._masks
        for key in keys:
            members.discard(key)
            mask = masks.get(key, 0) & keep
            if mask:
                masks[key] = mask
            else:
                masks.pop(key, None)

    def masks(self, keys: Sequence[int]) -> list[int]:
        get = self._masks.get
        with self._lock:
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

    def __len__(self) -> int:
        return len(self._masks)


class RedisMasks:
    """:class:`LocationMasks` in Redis (see the module docstring); ``client`` is a redis-py
    client (its socket timeout bounds every call). Writes go out as one pipeline per call."""

    _CLEAR_BATCH = 1000

    def __init__(self, client: Any, prefix: str = "kvtier-fleet") -> None:
        if not prefix or any(c in prefix for c in " \n\r\t"):
            raise ValueError(f"Redis prefix must be non-empty and without whitespace, got {prefix!r}")
        self.client = client
        self.prefix = prefix

    def _key(self, key: int) -> str:
        return f"{self.prefix}:k:{key:x}"

    def _set(self, bit: int) -> str:
        return f"{self.prefix}:l:{bit}"

    def add(self, bit: int, keys: Iterable[int]) -> None:
        self._set_bit(bit, list(keys), 1)

    def remove(self, bit: int, keys: Iterable[int]) -> None:
        keys = list(keys)
        self._set_bit(bit, keys, 0)
        if keys:
            self._drop_empty(keys)

    def _set_bit(self, bit: int, keys: list[int], value: int) -> None:
        """Set (1) or clear (0) ``bit`` of every key's bitmap and update the location's key set: one pipeline."""
        if not keys:
            return
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.setbit(self._key(key), bit, value)
        members = [f"{k:x}" for k in keys]
        if value:
            pipe.sadd(self._set(bit), *members)
        else:
            pipe.srem(self._set(bit), *members)
        pipe.execute()

    def _drop_empty(self, keys: list[int]) -> None:
        """Delete key bitmaps that hold no bit any more (BITCOUNT 0), so Redis does not keep them."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.bitcount(self._key(key))
        empty = [self._key(k) for k, n in zip(keys, pipe.execute(), strict=True) if not n]
        if empty:
            self.client.delete(*empty)

    def clear(self, bit: int) -> None:
        name = self._set(bit)
        while True:
            batch = self.client.spop(name, self._CLEAR_BATCH)
            if not batch:
                break
            keys = [int(k, 16) for k in batch]
            self._set_bit(bit, keys, 0)  # (the keys already left the set)
            self._drop_empty(keys)

    def masks(self, keys: Sequence[int]) -> list[int]:
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(self._key(key))
        return [_bitmap_mask(value) for value in pipe.execute()]

    def count(self, bit: int) -> int:
        return int(self.client.scard(self._set(bit)))

    def members(self, bit: int) -> set[int]:
        return {int(k, 16) for k in self.client.smembers(self._set(bit))}

    def put_meta(self, meta: dict[str, Any]) -> None:
        self.client.set(f"{self.prefix}:meta", json.dumps(meta, separators=(",", ":")))

    def get_meta(self) -> dict[str, Any]:
        raw = self.client.get(f"{self.prefix}:meta")
        if not raw:
            return {}
        meta = json.loads(raw)
        return meta if isinstance(meta, dict) else {}


def _bitmap_mask(value: bytes | None) -> int:
    """A Redis bitmap (bit 0 is the first byte's high bit) as an integer with bit i = offset i."""
    if not value:
        return 0
    mask = 0
    for index, byte in enumerate(value):
        if byte:
            for offset in range(8):
                if byte & (0x80 >> offset):
                    mask |= 1 << (index * 8 + offset)
    return mask
