"""The bench's simulated device: a KV pool with an LRU prefix cache, and the bytes each block must hold.

Used by :mod:`kvtier.workload.bench` from its one (scheduler) thread; the copy
engine's threads only read and write rows of :attr:`DevicePool.data`.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvtier.errors import ConfigError, KvtierError
from kvtier.keys import BlockKey
from kvtier.transfer import aligned_host_array


class BlockContent:
    """The bytes a block must hold: a fixed random pattern XOR a 64-bit word of its key.

    Position-dependent (the pattern is random per byte) and key-dependent (the
    word), so a wrong block, a shifted copy or a flipped byte all compare unequal.
    """

    def __init__(self, block_bytes: int, seed: int = 0) -> None:
        if block_bytes % 8:
            raise ConfigError(f"bench block size must be a multiple of 8 bytes, got {block_bytes}")
        rng = np.random.Generator(np.random.PCG64([seed, 0xB10C]))
        self.pattern = rng.integers(0, 2**63, size=block_bytes // 8, dtype=np.uint64)
        self._scratch = np.empty_like(self.pattern)

    @staticmethod
    def word(key: BlockKey) -> np.uint64:
        return np.uint64(int.from_bytes(key[:8], "little"))  # type: ignore[no-any-return,unused-ignore]

    def fill(self, key: BlockKey, out: np.ndarray) -> None:
        """Write the block's bytes into ``out`` (a uint8 row of block_bytes)."""
        np.bitwise_xor(self.pattern, self.word(key), out=out.view(np.uint64))

    def matches(self, key: BlockKey, data: np.ndarray) -> bool:
        """True if ``data`` holds exactly the block's bytes."""
        np.bitwise_xor(self.pattern, self.word(key), out=self._scratch)
        return bool(np.array_equal(self._scratch, data.view(np.uint64)))


class DevicePool:
    """The simulated device KV cache: slots, an LRU prefix cache of computed blocks, pins.

    ``loading`` holds keys whose CPU -> device copy is in flight; a request that
    needs one waits rather than computing it again.
    """

    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        # Page aligned and resident like a real engine's pool: numpy's own 16-byte offset made
        # loads (CPU -> device) 1.8x slower than stores, and lazily mapped pages fault on first copy.
        self.data = aligned_host_array((num_blocks, block_bytes))
        self.free = list(range(num_blocks - 1, -1, -1))
        self.cache: OrderedDict[BlockKey, int] = OrderedDict()
        self.pins = [0] * num_blocks
        self.loading: set[BlockKey] = set()

    def prefix(self, keys: list[BlockKey]) -> int:
        """How many leading ``keys`` the device cache holds."""
        n = 0
        for key in keys:
            if key not in self.cache:
                break
            n += 1
        return n

    def available(self, protected: set[int]) -> int:
        """Slots that :meth:`take` can hand out without touching ``protected`` or pinned ones."""
        free = len(self.free)
        return free + sum(1 for s in self.cache.values() if not self.pins[s] and s not in protected)

    def take(self, protected: set[int]) -> int:
        """A free slot, else the least recently used unpinned cached one (evicted)."""
        if self.free:
            return self.free.pop()
        for key, slot in self.cache.items():
            if not self.pins[slot] and slot not in protected:
                del self.cache[key]
                return slot
        raise KvtierError("device pool exhausted")  # callers check available() first

    def pin(self, slots: list[int]) -> None:
        for s in slots:
            self.pins[s] += 1

    def unpin(self, slots: list[int]) -> None:
        for s in slots:
            self.pins[s] -= 1
