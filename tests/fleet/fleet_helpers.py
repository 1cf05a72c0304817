"""Engines without vLLM for the fleet tests: a real TieringManager (CPU tier in /dev/shm, an fs
tier on a real directory) driven like an engine's scheduler, its EngineEventStream, and the
translation of the stream into decoded batches (what vLLM's publisher would carry)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from kvtier.engine_events import ControlRecord, EngineEventStream, StreamItem
from kvtier.fleet.records import Kind, WireBatch, WireEvent, block_key
from kvtier.keys import BlockKey, KVGeometry, Namespace, prefix_keys
from kvtier.manager import TieringManager
from kvtier.tiers.fs_layout import SUFFIX, entry_bytes
from kvtier.types import PRIMARY_LABEL, RequestContext

BLOCK = 4096
TOKENS = 16
NS = Namespace("test/fleet", KVGeometry.from_block_bytes(BLOCK))


def fleet_key(key: BlockKey) -> int:
    return block_key(bytes(key), 0)


def to_batch(items: list[StreamItem]) -> WireBatch:
    """The stream's items as the fleet decodes them from vLLM's publisher: control records
    through their string form, CPU events as medium CPU, secondary tiers' as STORAGE with the
    tier label as ownership."""
    events: list[WireEvent] = []
    for item in items:
        if isinstance(item, ControlRecord):
            events.append(WireEvent(Kind.CONTROL, control=ControlRecord.decode(item.encode())))
            continue
        primary = item.tier == PRIMARY_LABEL
        events.append(
            WireEvent(
                Kind.REMOVED if item.removed else Kind.STORED,
                tuple(fleet_key(k) for k in item.keys),
                "CPU" if primary else "STORAGE",
                None if primary else item.tier,
            )
        )
    return WireBatch(time.time(), events, 0)


def disk_keys(root: Path) -> set[int]:
    """The fleet keys of the value files in an fs root (the store's truth)."""
    ns_dir = root / NS.hexdigest
    return {
        fleet_key(bytes.fromhex(p.name[: -len(SUFFIX)]))
        for p in ns_dir.glob(f"[0-9a-f][0-9a-f]/*{SUFFIX}")
        if p.is_file() and not p.is_symlink()
    }


def prompt_keys(seed: int, blocks: int, shared: int = 0, shared_seed: int = 0) -> list[BlockKey]:
    """Keys of a prompt whose first ``shared`` blocks come from ``shared_seed``'s prompt."""
    head = np.random.default_rng(shared_seed).integers(0, 50_000, shared * TOKENS)
    tail = np.random.default_rng(seed).integers(0, 50_000, (blocks - shared) * TOKENS)
    return prefix_keys(np.concatenate([head, tail]), TOKENS, namespace=NS)


class Engine:
    """A TieringManager with a CPU tier of ``cpu_blocks`` rows and an fs tier under ``root``
    bounded to ``fs_files`` files (shared by every engine using the root), or the secondary
    tier ``tier`` instead, and its stream."""

    def __init__(self, name: str, root: Path, cpu_blocks: int = 8, fs_files: int = 24,
                 tier: dict[str, object] | None = None, **fs: object) -> None:  # fmt: skip
        self.name = name
        self.root = root
        spec = tier or {"type": "fs", "root": str(root), "max_bytes": fs_files * entry_bytes(BLOCK),
                        "read_threads": 1, "write_threads": 1, "scan_in_background": False, **fs}  # fmt: skip
        self.manager = TieringManager.create(namespace=NS, num_cpu_blocks=cpu_blocks, tiers=[spec])
        self.stream = EngineEventStream(self.manager, engine=name, info={"tokens_per_hash": TOKENS})
        self._requests = 0

    def _request(self) -> RequestContext:
        self._requests += 1
        return RequestContext(f"{self.name}-{self._requests}")

    def store(self, keys: list[BlockKey]) -> None:
        """A request computed ``keys``: offload them (and cascade to the fs tier)."""
        req = self._request()
        mgr = self.manager
        mgr.on_new_request(req)
        result = mgr.prepare_store(keys, req)
        if result is not None:
            for key, slot in zip(result.keys_to_store, result.slots, strict=True):
                mgr.rows[slot, :BLOCK] = np.frombuffer(key * (BLOCK // len(key)), dtype=np.uint8)
            mgr.complete_store(result.keys_to_store, req)
        mgr.on_request_finished(req)
        mgr.on_schedule_end()

    def load(self, keys: list[BlockKey], timeout: float = 30.0) -> int:
        """A request for ``keys``: the engine's prefix scan, promotions included, then the load
        of what is ready; returns how many leading blocks it loaded."""
        req = self._request()
        mgr = self.manager
        mgr.on_new_request(req)
        deadline = time.monotonic() + timeout
        while True:
            found = mgr.lookup_prefix(keys, req)
            if not found.deferred:
                break
            assert time.monotonic() < deadline, "lookups stayed deferred"
            mgr.on_schedule_end()
            time.sleep(0.002)
        if found.ready:
            mgr.prepare_load(keys[: found.ready], req)
            mgr.complete_load(keys[: found.ready], req)
        mgr.on_request_finished(req)
        mgr.on_schedule_end()
        return found.ready

    def settle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "tier jobs did not finish"
            self.manager.on_schedule_end()
            time.sleep(0.002)
        self.manager.on_schedule_end()

    def cpu_keys(self) -> set[int]:
        return {fleet_key(k) for k in self.manager.primary.ready_keys()}

    def take(self) -> WireBatch:
        return to_batch(self.stream.take())

    def shutdown(self) -> None:
        self.manager.shutdown()
