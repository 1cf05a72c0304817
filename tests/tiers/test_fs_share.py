"""Live sharing of an fs root between engines (issue 23, item 1): an engine finds the blocks other
live engines write into the same root and namespace, byte exact; planted entries stay ignored;
the root's size bound is shared by every engine (per-instance ledgers), proven with several
real processes, one of them killed with SIGKILL while writing."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from fs_helpers import AlignedRows, block_bytes_for, fill, key_of, load, make_tier, store, value_files
from fs_share_child import BB as CHILD_BB
from fs_share_child import NS as CHILD_NS
from fs_share_child import prompt_keys

from kvtier.errors import ConfigError
from kvtier.tiers import fs_journal
from kvtier.tiers.base import HealthState
from kvtier.tiers.format import HEADER_SIZE
from kvtier.tiers.fs import FilesystemTier, verify_root
from kvtier.tiers.fs_budget import RECORD_BYTES as LEDGER_RECORD_BYTES
from kvtier.tiers.fs_budget import pack_record, parse_record
from kvtier.tiers.fs_journal import (
    ADDED,
    RECORD_BYTES,
    REMOVED,
    JournalReader,
    JournalWriter,
    pack_entry,
    parse_entries,
)
from kvtier.tiers.fs_layout import JOURNAL_DIR, LEDGER_DIR, PAYLOAD_OFFSET, entry_bytes, value_path
from kvtier.tiers.fs_share import PATIENCE
from kvtier.types import LookupResult, RequestContext

BB = 16 * 1024
ENTRY = entry_bytes(BB)
IS_ROOT = os.geteuid() == 0
CHILD = Path(__file__).with_name("fs_share_child.py")


@pytest.fixture
def rows() -> Iterator[np.ndarray]:
    yield AlignedRows(32, BB).rows


def _ask(tier: FilesystemTier, keys: list[bytes], request: RequestContext | None = None) -> list[LookupResult]:
    """Look ``keys`` up as an engine does, step by step, until no answer is RETRY."""
    deadline = time.monotonic() + 10
    while True:
        answers = [tier.lookup(k, request) for k in keys]
        if LookupResult.RETRY not in answers:
            return answers
        assert time.monotonic() < deadline, answers
        tier.on_schedule_end()
        while tier.has_pending_work() and time.monotonic() < deadline:
            time.sleep(0.001)


def _ledgers(ns_dir: Path) -> dict[str, int | None]:
    return {p.name: parse_record(p.read_bytes()) for p in (ns_dir / LEDGER_DIR).iterdir() if p.is_file()}


def _ledger_sum(ns_dir: Path) -> int:
    return sum(n or 0 for n in _ledgers(ns_dir).values())


# --- one engine finds another's blocks ------------------------------------------------------------


def _until_hit(tier: FilesystemTier, key: bytes, timeout: float = 5.0) -> float:
    """Seconds until ``tier`` answers HIT for ``key`` from memory (never RETRY: no miss_checks)."""
    t0 = time.monotonic()
    while (answer := tier.lookup(key, None)) is not LookupResult.HIT:
        assert answer is LookupResult.MISS, answer
        assert time.monotonic() - t0 < timeout, "never learned of the other engine's block"
        time.sleep(0.005)
    return time.monotonic() - t0


@pytest.mark.parametrize("miss_checks", [False, True])
def test_an_engine_running_before_another_writes_hits_its_blocks(
    tmp_path: Path, rows: np.ndarray, miss_checks: bool
) -> None:
    """The issue's measurement: B starts, then A writes 16 blocks; B used to find 0 of 16 (its
    index was built at start and never learned of a live peer's files). From A's journal B
    learns them within a few housekeeping ticks and answers HIT from memory; with miss_checks
    its first lookup answers RETRY and a check on disk finds them."""
    other = AlignedRows(32, BB).rows
    b = make_tier(tmp_path, rows, BB, miss_checks=miss_checks)
    a = make_tier(tmp_path, other, BB)
    try:
        keys = [key_of(i, b"a-wrote") for i in range(16)]
        fill(other, range(16), keys, BB)
        assert store(a, keys, range(16)).success
        if miss_checks:
            deadline = time.monotonic() + 5
            while not b.describe()["miss_checks_active"]:  # b notices a at its next housekeeping
                assert time.monotonic() < deadline
                time.sleep(0.01)
            request = RequestContext("r")
            answers = _ask(b, keys, request)
        else:
            assert _until_hit(b, keys[-1]) < 2.0
            answers = [b.lookup(k, None) for k in keys]
        assert answers == [LookupResult.HIT] * 16
        rows[:16] = 0
        assert load(b, keys, range(16)).success
        for i, key in enumerate(keys):
            assert np.array_equal(rows[i, :BB], block_bytes_for(key, BB))
        learned = b.stats.extra["checks_found"] + b.stats.extra["journal_added"]
        assert learned >= 16 and b.stats.corrupt_values == 0
    finally:
        a.shutdown()
        b.shutdown()


def test_evictions_of_another_engine_reach_the_index_through_its_journal(tmp_path: Path, rows: np.ndarray) -> None:
    other = AlignedRows(8, BB).rows
    b = make_tier(tmp_path, rows, BB)
    a = make_tier(tmp_path, other, BB, max_bytes=2 * ENTRY)
    try:
        keys = [key_of(i, b"journal-evicted") for i in range(4)]
        fill(other, range(4), keys, BB)
        assert store(a, keys[:2], [0, 1]).success
        _until_hit(b, keys[1])
        assert store(a, keys[2:], [2, 3]).success  # evicts keys[:2]
        deadline = time.monotonic() + 5
        while any(b.lookup(k, None) is LookupResult.HIT for k in keys[:2]):
            assert time.monotonic() < deadline, "the evictions never reached b"
            time.sleep(0.005)
        assert b.stats.extra["journal_removed"] == 2
        _until_hit(b, keys[3])
        assert load(b, keys[2:], [0, 1]).success
    finally:
        a.shutdown()
        b.shutdown()


def test_an_announcement_read_after_this_engine_deleted_the_file_does_not_revive_it() -> None:
    """Regression: engine B's journal said "k added at t0"; A evicted k's file at t1 > t0 and read
    B's record after that: A's index held k again (a HIT for a block nobody has, and a snapshot of
    A's holdings listing it). A newer file of k (stored after the deletion) is still learned."""
    from kvtier.tiers.fs_index import FileIndex

    index = FileIndex()
    key = key_of(1, b"revived")
    index.add_found([(time.time() - 10, key)])
    assert index.take_victims(1) == [key]
    index.finish_delete([key])
    assert index.add_found([(time.time() - 5, key)]) == 0 and key not in index
    assert index.add_found([(time.time() + 1, key)]) == 1 and key in index


def _settled_removal(tier: FilesystemTier, key: bytes, timeout: float = 5.0) -> list[float]:
    """Times of ``tier``'s removal events of ``key`` once it answers MISS for it (fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    removals: list[float] = []
    while tier.lookup(key, None) is LookupResult.HIT:
        assert time.monotonic() < deadline, "a peer's removal of a file gone from disk never reached the index"
        removals += [e.time for e in tier.take_events() if e.removed and key in e.keys]
        time.sleep(0.005)
    time.sleep(0.02)  # the event is queued after the index dropped the key
    return removals + [e.time for e in tier.take_events() if e.removed and key in e.keys]


def test_a_peers_removal_timed_before_this_engines_store_is_checked_on_disk(tmp_path: Path, rows: np.ndarray) -> None:
    """Regression (the fleet reconstruction test's rare failure under load): engine B unlinked the
    file engine A had just linked, but B's removal was timed (before its unlink started) earlier than
    A's store (timed once its file was visible). A's index kept the key for good (a removal older than
    its own proof of the file) and a fleet index, applying the latest change per key, kept A's store:
    both believed in a file gone from disk. Now such a removal is checked on disk: gone, A drops the
    key and reports a removal timed after its store; still there (B removed an older file of the key
    before A stored it), A keeps it and reports nothing."""
    tier = make_tier(tmp_path, rows, BB)
    peer = JournalWriter(tier._dirs, "9-cccccccccccc")  # a peer's journal: the records it writes
    try:
        keys = [key_of(i, b"raced") for i in range(2)]
        fill(rows, range(2), keys, BB)
        before = time.time() - 1.0  # the peer's removals are timed before A's stores
        assert store(tier, keys, [0, 1]).success
        stored = {e.keys[0]: e.time for e in tier.take_events() if not e.removed}
        assert set(stored) == set(keys) and all(t > before for t in stored.values())
        os.unlink(value_path(tier.ns_dir, keys[0]))  # the peer unlinked A's new file of keys[0]...
        for key in keys:  # ...and of keys[1] only an older one: A's file is still there
            peer.append(REMOVED, [key], when=before)
        peer.flush()
        removals = _settled_removal(tier, keys[0])
        assert len(removals) == 1 and removals[0] > stored[keys[0]]
        assert tier.stats.extra["journal_removed"] == 1
        time.sleep(0.2)  # several journal reads later
        assert tier.lookup(keys[1], None) is LookupResult.HIT
        assert not [e for e in tier.take_events() if e.removed]
        assert load(tier, keys[1:], [5]).success
        assert np.array_equal(rows[5, :BB], block_bytes_for(keys[1], BB))
    finally:
        peer.close()
        tier.shutdown()


def test_a_peers_removal_of_a_key_being_loaded_here_is_applied_once_the_load_is_over(
    tmp_path: Path, rows: np.ndarray
) -> None:
    """A removal read while a load reads the key (pinned) used to be dropped: the index kept a key
    whose file was gone until some later load found it vanished. It is applied again at the next
    journal read once the pin is gone."""
    tier = make_tier(tmp_path, rows, BB)
    peer = JournalWriter(tier._dirs, "9-bbbbbbbbbbbb")
    try:
        key = key_of(0, b"pinned")
        fill(rows, [0], [key], BB)
        assert store(tier, [key], [0]).success
        tier.take_events()
        assert tier._index.pin(key)  # what a load in flight holds
        os.unlink(value_path(tier.ns_dir, key))
        peer.append(REMOVED, [key])  # timed now: after A's store
        peer.flush()
        time.sleep(0.3)  # several journal reads: the key stays while pinned
        assert tier.lookup(key, None) is LookupResult.HIT
        tier._index.unpin(key)
        _settled_removal(tier, key)
        assert tier.stats.extra["journal_removed"] == 1
    finally:
        peer.close()
        tier.shutdown()


def test_sharing_off_keeps_the_index_built_at_start(tmp_path: Path, rows: np.ndarray) -> None:
    other = AlignedRows(4, BB).rows
    b = make_tier(tmp_path, rows, BB, sharing=False)
    a = make_tier(tmp_path, other, BB)
    try:
        key = key_of(1)
        fill(other, [0], [key], BB)
        assert store(a, [key], [0]).success
        time.sleep(0.3)
        assert b.lookup(key, None) is LookupResult.MISS
        assert b.stats.extra["journal_added"] == 0 and b.stats.extra["checks"] == 0
    finally:
        a.shutdown()
        b.shutdown()


def test_a_lone_engine_with_miss_checks_answers_miss_at_once_until_a_peer_appears(
    tmp_path: Path, rows: np.ndarray
) -> None:
    tier = make_tier(tmp_path, rows, BB, miss_checks=True)
    try:
        unknown = key_of(5, b"nobody")
        assert tier.lookup(unknown, None) is LookupResult.MISS  # no RETRY, no check: nobody else is here
        assert tier.stats.extra["checks"] == 0
        peer = make_tier(tmp_path, AlignedRows(2, BB).rows, BB)
        try:
            _wait_checks_active(tier)
        finally:
            peer.shutdown()
        assert tier.lookup(unknown, None) is LookupResult.RETRY  # sticky: the peer's files stay
    finally:
        tier.shutdown()


def _deaf(tier: FilesystemTier) -> FilesystemTier:
    """Stop ``tier`` following other engines' journals: what it learns comes from its checks on
    disk alone (as when the writer is an older release that keeps no journal)."""
    follow = tier._follow
    tier._follow = None
    if follow is not None:
        follow.close()
    return tier


def _wait_checks_active(tier: FilesystemTier) -> None:
    deadline = time.monotonic() + 5
    while not tier.describe()["miss_checks_active"]:
        assert time.monotonic() < deadline, "the peer was never noticed"
        time.sleep(0.01)


def test_keys_nobody_has_miss_from_a_negative_cache_then_are_checked_again(tmp_path: Path, rows: np.ndarray) -> None:
    other = AlignedRows(4, BB).rows
    b = _deaf(make_tier(tmp_path, rows, BB, miss_checks=True, miss_seconds=0.3))
    a = make_tier(tmp_path, other, BB)
    try:
        _wait_checks_active(b)
        key = key_of(9, b"later")
        assert _ask(b, [key]) == [LookupResult.MISS]
        assert b.stats.extra["checks"] == 1
        for _ in range(100):  # within miss_seconds: answered from memory, nothing checked
            assert b.lookup(key, None) is LookupResult.MISS
        assert b.stats.extra["checks"] == 1 and not b.has_pending_work()
        fill(other, [0], [key], BB)
        assert store(a, [key], [0]).success
        assert b.lookup(key, None) is LookupResult.MISS  # the short negative cache: still absent for b
        time.sleep(0.35)
        assert _ask(b, [key]) == [LookupResult.HIT]
        assert b.stats.extra["checks"] == 2
    finally:
        a.shutdown()
        b.shutdown()


def test_a_chain_is_checked_in_prefix_order_up_to_its_first_absent_key(tmp_path: Path, rows: np.ndarray) -> None:
    other = AlignedRows(8, BB).rows
    b = make_tier(tmp_path, rows, BB, miss_checks=True, sharing=True)
    a = make_tier(tmp_path, other, BB)
    try:
        _wait_checks_active(_deaf(b))
        keys = [key_of(i, b"chain") for i in range(6)]
        present = keys[:2] + keys[3:]  # keys[2] is nobody's
        fill(other, range(5), present, BB)
        assert store(a, present, range(5)).success
        request = RequestContext("chain")
        assert [b.lookup(k, request) for k in keys] == [LookupResult.RETRY] * 6
        b.on_schedule_end()
        while b.has_pending_work():
            time.sleep(0.001)
        assert b.stats.extra["checks"] == 3  # keys[0], keys[1], keys[2]: the chain stopped there
        assert [b.lookup(k, request) for k in keys[:3]] == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
    finally:
        a.shutdown()
        b.shutdown()


def test_a_check_that_does_not_come_back_answers_miss_after_patience(tmp_path: Path, rows: np.ndarray) -> None:
    tier = make_tier(tmp_path, rows, BB, miss_checks=True, read_threads=1, write_threads=1)
    peer = make_tier(tmp_path, AlignedRows(2, BB).rows, BB)
    try:
        _wait_checks_active(tier)
        gate = threading.Event()
        real = tier._probe_key

        def stuck(key: bytes) -> bool:  # a hung network file system, simulated on the check only
            gate.wait(10)
            return real(key)

        tier._probe_key = stuck  # type: ignore[method-assign]
        key = key_of(1, b"hung")
        assert tier.lookup(key, None) is LookupResult.RETRY
        tier.on_schedule_end()
        time.sleep(0.05)
        assert tier.lookup(key, None) is LookupResult.RETRY
        time.sleep(PATIENCE + 0.1)
        assert tier.lookup(key, None) is LookupResult.MISS  # the engine recomputes, it never waits
        gate.set()
    finally:
        peer.shutdown()
        tier.shutdown()


# --- another engine's evictions and recycling ----------------------------------------------------


def test_a_block_another_engine_evicted_is_a_miss_not_an_error(tmp_path: Path, rows: np.ndarray) -> None:
    """b believes the files are there (its start-up scan saw them; it follows no journal here,
    as a slow one would be) when a evicts and recycles them: b's loads are misses."""
    other = AlignedRows(8, BB).rows
    a = make_tier(tmp_path, other, BB, max_bytes=2 * ENTRY)
    try:
        keys = [key_of(i, b"evicted") for i in range(4)]
        fill(other, range(4), keys, BB)
        assert store(a, keys[:2], [0, 1]).success
        b = make_tier(tmp_path, rows, BB, sharing=False, miss_checks=False)
        assert [b.lookup(k, None) for k in keys[:2]] == [LookupResult.HIT] * 2
        assert store(a, keys[2:], [2, 3]).success  # a evicts (and recycles) both files
        result = load(b, keys[:2], [0, 1])
        assert not result.success and result.successful_keys == frozenset()
        assert "vanished" in (result.error or "")
        assert b.stats.corrupt_values == 0 and b.stats.extra["vanished"] == 2
        assert b.health().state is HealthState.CLOSED and b.stats.extra["io_errors"] == 0
        assert [b.lookup(k, None) for k in keys[:2]] == [LookupResult.MISS] * 2
        b.shutdown()
        # a new engine finds what a now holds and loads it byte exact (recycled files, new names)
        b = make_tier(tmp_path, rows, BB)
        assert [b.lookup(k, None) for k in keys[2:]] == [LookupResult.HIT] * 2
        assert load(b, keys[2:], [4, 5]).success
        for i, key in enumerate(keys[2:]):
            assert np.array_equal(rows[4 + i, :BB], block_bytes_for(key, BB))
        b.shutdown()
    finally:
        a.shutdown()


# --- planted entries -------------------------------------------------------------------------------


def _value(key: bytes, namespace: bytes, payload: np.ndarray, *, header_key: bytes | None = None) -> bytes:
    """A well-formed value file for ``key`` (or one whose header names ``header_key``)."""
    from kvtier.tiers.format import ValueHeader, payload_checksum

    data = payload.tobytes()
    header = ValueHeader(namespace, header_key or key, len(data), payload_checksum(memoryview(data))).pack()
    return header + bytes(PAYLOAD_OFFSET - HEADER_SIZE) + data


def test_planted_entries_found_by_a_check_are_never_served(tmp_path: Path, rows: np.ndarray) -> None:
    """Entries named like values of keys nobody stored: a symlink to a file with valid bytes, a
    FIFO, a directory, a garbage file, a value of another key, a value of another namespace, a
    file of a wrong size. None is followed, blocks a check, or reaches a CPU row as a success;
    the regular ones fail verification once and are never adopted again."""
    tier = make_tier(tmp_path, rows, BB, miss_checks=True, direct_io=False)
    peer = make_tier(tmp_path, AlignedRows(2, BB).rows, BB)
    _wait_checks_active(tier)
    ns_dir = tier.ns_dir
    digest = bytes.fromhex(ns_dir.name)
    keys = {name: key_of(i, b"planted") for i, name in enumerate(
        ["symlink", "fifo", "directory", "garbage", "other_key", "other_namespace", "wrong_size"])}  # fmt: skip
    payload = block_bytes_for(keys["symlink"], BB)
    outside = tmp_path / "outside.kv"
    outside.write_bytes(_value(keys["symlink"], digest, payload))
    value_path(ns_dir, keys["symlink"]).symlink_to(outside)
    os.mkfifo(value_path(ns_dir, keys["fifo"]))
    value_path(ns_dir, keys["directory"]).mkdir()
    value_path(ns_dir, keys["garbage"]).write_bytes(os.urandom(PAYLOAD_OFFSET + BB))
    value_path(ns_dir, keys["other_key"]).write_bytes(
        _value(keys["other_key"], digest, payload, header_key=key_of(99, b"someone else"))
    )
    value_path(ns_dir, keys["other_namespace"]).write_bytes(_value(keys["other_namespace"], bytes(16), payload))
    value_path(ns_dir, keys["wrong_size"]).write_bytes(b"x" * 100)
    try:
        answers = dict(zip(keys, _ask(tier, list(keys.values())), strict=True))
        for name in ("symlink", "fifo", "directory", "wrong_size"):
            assert answers[name] is LookupResult.MISS, (name, answers)
        assert tier.stats.extra["unsafe_entries"] >= 3
        regular = [keys[n] for n in ("garbage", "other_key", "other_namespace")]
        assert all(answers[n] is LookupResult.HIT for n in ("garbage", "other_key", "other_namespace")), answers
        rows[:3] = 0
        result = load(tier, regular, range(3))
        assert not result.success and result.successful_keys == frozenset()
        assert tier.stats.corrupt_values == 3
        # they were ours (this user's): removed, as before; never served, never adopted again
        assert not any(value_path(ns_dir, k).exists() for k in regular)
        assert _ask(tier, regular) == [LookupResult.MISS] * 3
        assert outside.exists() and value_path(ns_dir, keys["symlink"]).is_symlink()
        assert value_path(ns_dir, keys["fifo"]).exists() and value_path(ns_dir, keys["directory"]).is_dir()
    finally:
        peer.shutdown()
        tier.shutdown()


@pytest.mark.skipif(not IS_ROOT, reason="making a file of another user needs root")
def test_another_users_planted_value_is_never_adopted_and_a_group_file_that_fails_is_not_retried(
    tmp_path: Path, rows: np.ndarray
) -> None:
    tier = make_tier(tmp_path, rows, BB, miss_checks=True)
    peer = make_tier(tmp_path, AlignedRows(2, BB).rows, BB)
    try:
        _wait_checks_active(tier)
        key = key_of(1, b"foreign")
        path = value_path(tier.ns_dir, key)
        path.write_bytes(_value(key, bytes.fromhex(tier.ns_dir.name), block_bytes_for(key, BB)))
        os.chown(path, 65534, 65534)
        assert _ask(tier, [key]) == [LookupResult.MISS]
        assert tier.stats.extra["unsafe_entries"] >= 1 and path.exists()
    finally:
        peer.shutdown()
        tier.shutdown()


def test_a_store_never_replaces_an_entry_at_its_name(tmp_path: Path, rows: np.ndarray) -> None:
    """Values are linked into place: a symlink planted at a key's name is left alone (the store
    of that key fails), and a value another engine linked first is kept (nothing written)."""
    tier = make_tier(tmp_path, rows, BB, sharing=True)
    other = AlignedRows(4, BB).rows
    peer = make_tier(tmp_path, other, BB, sharing=True)
    try:
        planted, shared = key_of(1, b"taken"), key_of(2, b"taken")
        target = tmp_path / "target"
        target.write_bytes(b"keep")
        value_path(tier.ns_dir, planted).symlink_to(target)
        fill(rows, [0, 1], [planted, shared], BB)
        result = store(tier, [planted], [0])
        assert not result.success and "not a value of ours" in (result.error or "")
        assert value_path(tier.ns_dir, planted).is_symlink() and target.read_bytes() == b"keep"
        fill(other, [0], [shared], BB)
        assert store(peer, [shared], [0]).success
        inode = value_path(tier.ns_dir, shared).stat().st_ino
        assert store(tier, [shared], [1]).success  # found on disk: skipped
        assert value_path(tier.ns_dir, shared).stat().st_ino == inode
        assert tier.stats.extra["stores_skipped"] == 1 and tier.lookup(shared, None) is LookupResult.HIT
    finally:
        peer.shutdown()
        tier.shutdown()


# --- journals ----------------------------------------------------------------------------------------


def test_planted_journal_entries_and_records_are_ignored_or_cost_only_a_miss(tmp_path: Path, rows: np.ndarray) -> None:
    """journal/ is untrusted too: a symlink, a FIFO and a foreign-named file are never opened (a
    FIFO never blocks the reader); garbled records are skipped; a well-formed record of a key
    with no file makes a lookup HIT whose load is a plain miss, never an error or wrong bytes."""
    tier = make_tier(tmp_path, rows, BB)
    journal = tier.ns_dir / JOURNAL_DIR
    ghost, real = key_of(1, b"ghost"), key_of(2, b"real")
    secret = tmp_path / "secret"
    secret.write_bytes(pack_entry(ADDED, key_of(3, b"via-link"), time.time()) * 3)
    (journal / "7-aaaaaaaaaaaa.1").symlink_to(secret)
    os.mkfifo(journal / "7-bbbbbbbbbbbb.1")
    (journal / "not-a-journal").write_bytes(pack_entry(ADDED, key_of(4, b"misnamed"), time.time()))
    garbled = bytearray(pack_entry(ADDED, key_of(5, b"garbled"), time.time()))
    garbled[20] ^= 0xFF
    (journal / "7-cccccccccccc.1").write_bytes(
        bytes(garbled) + os.urandom(80) + pack_entry(ADDED, ghost, time.time()) + b"torn record"
    )
    other = AlignedRows(2, BB).rows
    peer = make_tier(tmp_path, other, BB)
    try:
        fill(other, [0], [real], BB)
        assert store(peer, [real], [0]).success
        _until_hit(tier, real)
        _until_hit(tier, ghost)
        for planted in (key_of(3, b"via-link"), key_of(4, b"misnamed"), key_of(5, b"garbled")):
            assert tier.lookup(planted, None) is LookupResult.MISS
        assert tier._follow is not None and tier._follow.bad_records == 2
        assert tier._follow.unsafe_entries == 2  # the symlink and the FIFO
        rows[:2] = 0
        result = load(tier, [ghost, real], [0, 1])
        assert result.successful_keys == frozenset([real]) and "vanished" in (result.error or "")
        assert np.array_equal(rows[1, :BB], block_bytes_for(real, BB))
        assert tier.stats.corrupt_values == 0 and tier.health().state is HealthState.CLOSED
        assert secret.exists() and (journal / "7-bbbbbbbbbbbb.1").exists()
    finally:
        peer.shutdown()
        tier.shutdown()


def test_a_reader_follows_a_journal_across_segments_and_skips_what_was_deleted(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fs_journal, "SEGMENT_BYTES", 4 * RECORD_BYTES)
    tier = make_tier(tmp_path, rows, BB)
    writer = JournalWriter(tier._dirs, "9-dddddddddddd")
    reader = JournalReader(tier._dirs, "8-eeeeeeeeeeee")
    try:
        keys = [key_of(i, b"segments") for i in range(30)]

        def write(op: int, some: list[bytes]) -> None:
            for key in some:  # one flush per record: one append each
                writer.append(op, [key])
                writer.flush()

        write(ADDED, keys[:6])
        assert [k for _, _, k in reader.read()] == keys[:6]  # across the first rotation
        write(ADDED, keys[6:])  # 6 more rotations: the segments the reader was at are gone
        got = [k for _, _, k in reader.read()]
        assert got == keys[-len(got):] and 4 <= len(got) < 24  # skipped ahead, in order
        assert len(list((tier.ns_dir / JOURNAL_DIR).glob("9-dddddddddddd.*"))) <= 3
        writer.append(REMOVED, keys[:1])
        assert reader.read() == []  # buffered until flushed
        writer.flush()
        assert reader.read() == [(REMOVED, pytest.approx(time.time(), abs=5), keys[0])]
    finally:
        writer.close()
        reader.close()
        tier.shutdown()


def test_journals_of_dead_instances_are_deleted_once_stale(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = make_tier(tmp_path, rows, BB)
    fill(rows, [0], [key_of(1)], BB)
    assert store(first, [key_of(1)], [0]).success
    first.shutdown()
    journal = first.ns_dir / JOURNAL_DIR
    assert len(list(journal.iterdir())) == 1
    monkeypatch.setattr(fs_journal, "STALE_SECONDS", 0.0)
    second = make_tier(tmp_path, rows, BB)
    try:
        deadline = time.monotonic() + 5
        while len(list(journal.iterdir())) > 1:  # only the live one's own journal stays
            assert time.monotonic() < deadline, list(journal.iterdir())
            time.sleep(0.05)
        assert second.lookup(key_of(1), None) is LookupResult.HIT
    finally:
        second.shutdown()


def test_a_dead_instance_file_named_like_a_journal_is_deleted_only_if_it_is_one(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (review, 2026-12-06): the clean-up of dead instances' journals deleted any regular
    file of ours (or of the shared group) named like a segment, whatever it held. Now a segment goes
    only if empty (killed before its first record) or beginning with a valid record."""
    first = make_tier(tmp_path, rows, BB)
    fill(rows, [0], [key_of(1)], BB)
    assert store(first, [key_of(1)], [0]).success
    first.shutdown()
    journal = first.ns_dir / JOURNAL_DIR
    (real,) = journal.iterdir()
    garbage = journal / "4242-0123456789ab.1"
    garbage.write_text("notes of a user, not a journal\n" * 8)
    bad_record = journal / "4243-0123456789ab.1"
    bad_record.write_bytes(pack_entry(ADDED, b"k" * 32, 1.0)[:-1] + b"x")  # a record whose checksum fails
    empty = journal / "4244-0123456789ab.1"
    empty.touch()
    torn = journal / "4245-0123456789ab.1"  # its first append cut short (a full disk)
    torn.write_bytes(pack_entry(ADDED, b"k" * 32, 1.0)[:30])
    monkeypatch.setattr(fs_journal, "STALE_SECONDS", 0.0)
    second = make_tier(tmp_path, rows, BB)
    try:
        deadline = time.monotonic() + 5
        while real.exists() or empty.exists() or torn.exists():
            assert time.monotonic() < deadline, sorted(p.name for p in journal.iterdir())
            time.sleep(0.05)
        time.sleep(0.3)  # several clean-ups later
        assert garbage.read_text().startswith("notes of a user") and bad_record.exists()
    finally:
        second.shutdown()
    kept = [r.getMessage() for r in caplog.records if "keeping journal/" in r.getMessage()]
    assert sorted(m.split("journal/")[1].split(" ")[0] for m in kept) == sorted([bad_record.name, garbage.name])


def test_journal_records_round_trip() -> None:
    record = pack_entry(REMOVED, b"k" * 36, 123.5)
    assert len(record) == RECORD_BYTES
    assert parse_entries(record * 2) == ([(REMOVED, 123.5, b"k" * 36)] * 2, 0)
    assert parse_entries(record[:-1] + b"x") == ([], 1)
    assert parse_entries(b"") == ([], 0)


# --- the shared size bound --------------------------------------------------------------------------


def test_engines_sharing_a_root_share_its_bound_and_evict_each_others_files(tmp_path: Path) -> None:
    """Three engines, one max_bytes: the namespace never holds more, whoever wrote what; an engine
    that knows none of the files on disk (it started before they were written) still makes
    room by evicting them; the ledgers sum to the files on disk once everyone is done."""
    budget = 6
    all_rows = [AlignedRows(16, BB).rows for _ in range(3)]
    tiers = [make_tier(tmp_path, r, BB, max_bytes=budget * ENTRY) for r in all_rows]
    ns_dir = tiers[0].ns_dir
    try:
        for t, tier in enumerate(tiers):  # the last one started before any file was written
            keys = [key_of(i, f"engine-{t}".encode()) for i in range(8)]
            fill(all_rows[t], range(8), keys, BB)
            for i in range(0, 8, 2):
                assert store(tier, keys[i : i + 2], [i, i + 1]).success
                assert len(value_files(tmp_path)) <= budget
        assert len(value_files(tmp_path)) == budget
        assert all(t.stats.evictions > 0 for t in tiers[1:])  # they evicted files they did not write
        newest = [key_of(i, b"engine-2") for i in range(6, 8)]
        for key in newest:
            _until_hit(tiers[0], key)  # from engine 2's journal
        assert _ledger_sum(ns_dir) == budget
        assert tiers[0].usage().used_bytes == budget * ENTRY  # the namespace's bytes, not one engine's
    finally:
        for tier in tiers:
            tier.shutdown()
    assert _ledger_sum(ns_dir) == budget


def _stored_by_a_gone_engine(root: Path, rows: np.ndarray, tag: bytes, n: int) -> Path:
    """An engine stores ``n`` blocks under ``root`` and shuts down; returns the namespace directory."""
    tier = make_tier(root, rows, BB)
    keys = [key_of(i, tag) for i in range(n)]
    fill(rows, range(n), keys, BB)
    assert store(tier, keys, range(n)).success
    tier.shutdown()
    return tier.ns_dir


def test_a_dead_instances_ledger_is_adopted_and_a_lone_start_corrects_drift(tmp_path: Path, rows: np.ndarray) -> None:
    ns_dir = _stored_by_a_gone_engine(tmp_path, rows, b"ledger", 5)
    assert list(_ledgers(ns_dir).values()) == [5]
    # a crash between claim and link leaves the count too high (here: by 3)
    (name,) = _ledgers(ns_dir)
    (ns_dir / LEDGER_DIR / name).write_bytes(pack_record(8, 99))
    again = make_tier(tmp_path, rows, BB)
    try:
        assert again.describe()["ledgers_adopted"] == 1
        assert again.usage().used_bytes == 5 * ENTRY  # alone at start: reset to what the scan counted
        assert _ledger_sum(ns_dir) == 5 and len(_ledgers(ns_dir)) == 1
    finally:
        again.shutdown()


def test_files_without_a_ledger_are_counted_at_start(tmp_path: Path, rows: np.ndarray) -> None:
    """A root written by an older release (no ledgers) is bounded too: the scan's count is added."""
    ns_dir = _stored_by_a_gone_engine(tmp_path, rows, b"legacy", 6)
    for ledger in (ns_dir / LEDGER_DIR).iterdir():
        ledger.unlink()
    live = make_tier(tmp_path, AlignedRows(2, BB).rows, BB)  # not alone: only ever adds
    again = make_tier(tmp_path, rows, BB, max_bytes=4 * ENTRY)
    try:
        assert len(value_files(tmp_path)) == 4
        assert _ledger_sum(ns_dir) >= 4
    finally:
        again.shutdown()
        live.shutdown()


def test_planted_ledger_entries_are_ignored(tmp_path: Path, rows: np.ndarray) -> None:
    tier = make_tier(tmp_path, rows, BB)
    tier.shutdown()
    ledgers = tier.ns_dir / LEDGER_DIR
    for p in ledgers.iterdir():
        p.unlink()
    secret = tmp_path / "secret"
    secret.write_bytes(pack_record(10**6, 1))
    (ledgers / "1-aaaaaaaaaaaa").symlink_to(secret)
    os.mkfifo(ledgers / "2-bbbbbbbbbbbb")
    (ledgers / "3-cccccccccccc").write_bytes(b"garbage" * 5)
    bad = bytearray(pack_record(10**6, 1))
    bad[10] ^= 1
    (ledgers / "4-dddddddddddd").write_bytes(bytes(bad))
    (ledgers / "not-a-ledger").write_bytes(pack_record(10**6, 1))
    done = threading.Event()
    made: list[FilesystemTier] = []

    def build() -> None:
        made.append(make_tier(tmp_path, rows, BB, max_bytes=3 * ENTRY))
        done.set()

    threading.Thread(target=build, daemon=True).start()
    assert done.wait(20), "a planted FIFO blocked the start"
    (again,) = made
    try:
        keys = [key_of(i, b"after-plant") for i in range(3)]
        fill(rows, range(3), keys, BB)
        assert store(again, keys, range(3)).success
        assert all(again.lookup(k, None) is LookupResult.HIT for k in keys)  # none counted as full
        assert again.usage().used_bytes == 3 * ENTRY
    finally:
        again.shutdown()
    assert secret.read_bytes() == pack_record(10**6, 1)
    assert (ledgers / "1-aaaaaaaaaaaa").is_symlink() and (ledgers / "2-bbbbbbbbbbbb").exists()


def test_ledger_records_round_trip_and_reject_damage() -> None:
    record = pack_record(-7, 3)
    assert len(record) == LEDGER_RECORD_BYTES and parse_record(record) == -7
    assert parse_record(b"") == 0
    assert parse_record(record[:-1]) is None
    assert parse_record(b"X" + record[1:]) is None
    head = struct.pack("<8sqQ", b"KVLEDGR1", 5, 1)
    assert parse_record(head + xxhash.xxh64_intdigest(head).to_bytes(8, "little")) == 5


@pytest.mark.parametrize(
    "options", [{"sharing": "yes"}, {"sharing": None}, {"miss_checks": "auto"}, {"miss_seconds": 0}]
)
def test_bad_sharing_options_are_config_errors(tmp_path: Path, rows: np.ndarray, options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"sharing|miss_checks|miss_seconds"):
        make_tier(tmp_path, rows, BB, **options)


# --- real processes -----------------------------------------------------------------------------------


class EngineProcess:
    """A fs_share_child.py engine: one command per line in, one JSON line out."""

    def __init__(self, root: Path, max_bytes: int, **options: Any) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(root), str(max_bytes), json.dumps(options)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.read() == {"ready": True}

    def read(self, timeout: float = 120.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"engine {self.proc.pid} did not answer within {timeout}s"
        line = self.proc.stdout.readline()
        if not line:
            stderr = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"engine exited: {stderr[-3000:]}")
        return dict(json.loads(line)) if line.startswith("{") else {"line": line.strip()}

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.close_pipes()

    def quit(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.close_pipes()

    def close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.mark.slow
@pytest.mark.usefixtures("shm_leak_check")
@pytest.mark.parametrize("options", [{}, {"miss_checks": True}], ids=["journals", "miss_checks"])
def test_engines_in_separate_processes_share_a_root_through_the_public_api(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    """Acceptance: B and C run before A writes; they HIT A's 16 blocks byte exact through
    TieringManager (HIT_PENDING, then HIT; with miss_checks RETRY first). Planted entries named
    like blocks of prompts nobody stored are never served. D, writing in a loop, is killed with
    SIGKILL; nobody gets a wrong byte, all keep working, and D restarted under the same names works."""
    root = tmp_path / "root"
    budget = 400 * entry_bytes(CHILD_BB)
    ns_dir = root / CHILD_NS.hexdigest
    engines: list[EngineProcess] = []
    try:
        b, c = EngineProcess(root, budget, **options), EngineProcess(root, budget, **options)
        engines += [b, c]
        a = EngineProcess(root, budget, **options)
        engines.append(a)
        assert a.ask("store shared 16") == {"stored": 16}
        time.sleep(0.5)  # journals are read (and peers noticed) at each housekeeping tick (0.1 s)
        for engine in (b, c):
            got = engine.ask("fetch shared 16")
            assert got["hits"] == 16 and got["wrong"] == 0, got
        # planted entries under the first block's name of prompts nobody stored
        secret = tmp_path / "secret"
        secret.write_bytes(bytes(PAYLOAD_OFFSET + CHILD_BB))
        value_path(ns_dir, prompt_keys("hostile-link", 1)[0]).symlink_to(secret)
        os.mkfifo(value_path(ns_dir, prompt_keys("hostile-fifo", 1)[0]))
        value_path(ns_dir, prompt_keys("hostile-garbage", 1)[0]).write_bytes(os.urandom(PAYLOAD_OFFSET + CHILD_BB))
        for engine in (b, c):
            for kind in ("link", "fifo", "garbage"):
                got = engine.ask(f"fetch hostile-{kind} 4")
                assert got["hits"] == 0 and got["wrong"] == 0, (kind, got)
        # D writes in a loop and is killed mid-write
        d = EngineProcess(root, budget, **options)
        engines.append(d)
        assert d.proc.stdin is not None
        d.proc.stdin.write("write 30 7\n")
        d.proc.stdin.flush()
        assert d.read() == {"line": "writing"}
        time.sleep(random.uniform(0.5, 1.5))
        d.kill()
        engines.remove(d)
        for engine in (a, b, c):
            for tag in ("shared", *(f"pool-{i}" for i in range(40))):
                got = engine.ask(f"fetch {tag} 8")
                assert got["wrong"] == 0, (tag, got)
            assert engine.ask("store after-kill 8")["stored"] in (0, 8)
            assert engine.ask("fetch shared 16")["wrong"] == 0
        d = EngineProcess(root, budget, **options)  # restarted: same root, same namespace, same prompts
        engines.append(d)
        got = d.ask("fetch shared 16")
        assert got["hits"] == 16 and got["wrong"] == 0, got
        assert d.ask("store restarted 8")["stored"] == 8
        deadline = time.monotonic() + 5
        while (got := b.ask("fetch restarted 8"))["hits"] < 8:  # d's journal reaches b within ~0.2 s
            assert got["wrong"] == 0 and time.monotonic() < deadline, got
            time.sleep(0.05)
        stats = [e.ask("stats")["stats"] for e in engines]
        corrupt = [s["corrupt_values"] for s in stats]
        # the planted garbage file: no journal announces it; a check on disk finds it, then one of b, c
        # loads it, fails its verification and removes it (it was this user's); nothing else is corrupt
        planted = 1 if options.get("miss_checks") else 0
        assert corrupt[0] + corrupt[1] == planted and corrupt[2:] == [0, 0], stats
    finally:
        for engine in engines:
            engine.quit()
    report = verify_root(root)
    bad = [Path(c.path).name for ns in report.namespaces for c in ns.corrupt]
    garbage = value_path(ns_dir, prompt_keys("hostile-garbage", 1)[0]).name
    assert bad == ([] if options.get("miss_checks") else [garbage])  # only the planted file, never loaded
    assert len(value_files(ns_dir)) * entry_bytes(CHILD_BB) <= budget


BOUND_CHILD = Path(__file__).with_name("fs_bound_child.py")
BOUND_FILES = 24  # the shared budget of the bound tests, in files of 16 KiB blocks
READS_PER_ENGINE = 2  # fs_bound_child.py's read threads


def _start_bound_engine(root: Path, seed: int, seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(BOUND_CHILD), str(root), str(seed), str(seconds), str(BOUND_FILES)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", f"engine failed to start: {line!r} {proc.stderr.read() if proc.stderr else ''}"
    return proc


def _go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def _counters(proc: subprocess.Popen[str], timeout: float) -> dict[str, int]:
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, stderr[-3000:]
    return dict(json.loads(stdout.strip().splitlines()[-1]))


class _Usage:
    """The bytes in use on a tmpfs of its own (statvfs: an atomic view; a directory walk races
    with links and evictions), sampled in a thread; ``peak`` is the most seen above ``baseline``."""

    def __init__(self, mount: Path) -> None:
        self.mount = mount
        self.baseline = self.used()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def used(self) -> int:
        st = os.statvfs(self.mount)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used() - self.baseline)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(10)
        return self.peak


@pytest.fixture
def tmpfs_root(tmp_path: Path) -> Iterator[Path | None]:
    """A 32 MiB tmpfs for the bound tests' byte sampling, its namespace's journal directory on a
    tmpfs of its own (journals live outside max_bytes, up to 3 MiB per engine), so statvfs of
    the root counts value and temp files only; None where mounting needs root."""
    from fs_helpers import mount_tmpfs

    mount = tmp_path / "mnt"
    if mount_tmpfs(mount, "32m") is not None:
        yield None
        return
    journals = None
    try:
        make_tier(mount, AlignedRows(1, BB).rows, BB).shutdown()  # creates the namespace directory
        (journals,) = mount.glob(f"*/{JOURNAL_DIR}")
        assert mount_tmpfs(journals, "32m") is None
        yield mount
    finally:
        if journals is not None:
            subprocess.run(["umount", "-l", str(journals)], check=False)
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_three_processes_keep_the_shared_bound_and_read_only_exact_bytes(
    tmp_path: Path, tmpfs_root: Path | None
) -> None:
    """Three engines, one pool of keys, one budget of 24 files: each store claims its file in the
    shared ledgers before linking it, so the namespace's value files never exceed the budget
    (bytes in use are sampled on a tmpfs of its own: the only excess allowed is files that a
    read still holds open after another engine evicted them, at most one per read thread); every
    block loaded is byte exact; the engines find and load each other's blocks; and once they
    are done the ledgers add up to exactly the files on disk."""
    root = tmpfs_root or tmp_path / "root"
    engines = [_start_bound_engine(root, seed, seconds=4.0) for seed in range(3)]
    usage = _Usage(tmpfs_root) if tmpfs_root is not None else None
    for proc in engines:
        _go(proc)
    counters = [_counters(proc, timeout=120) for proc in engines]
    peak = usage.stop() if usage is not None else None
    ns_dir = next(p for p in root.iterdir() if p.is_dir() and len(p.name) == 32)
    files = len(value_files(ns_dir))
    print(f"counters {counters}; peak {peak} bytes; {files} files at the end")
    for c in counters:
        assert c["wrong_bytes"] == 0 and c["corrupt"] == 0 and c["io_errors"] == 0, counters
        assert c["loads_ok"] > 0 and c["evictions"] > 0 and c["journal_added"] > 0, counters
    assert files <= BOUND_FILES
    assert _ledger_sum(ns_dir) == files, "the ledgers count exactly the files on disk"
    if peak is not None:
        assert peak <= (BOUND_FILES + 3 * READS_PER_ENGINE) * ENTRY, f"peak {peak} bytes"


@pytest.mark.slow
def test_an_engine_killed_while_writing_costs_no_wrong_bytes_and_its_share_is_adopted(tmp_path: Path) -> None:
    """Three engines on one root; one is killed with SIGKILL in the middle of its work and
    restarted under the same names (same root, namespace and keys). The survivors keep working
    with no wrong byte and no corrupt value; the restarted engine works; a survivor adopts the
    dead engine's ledger; the bound holds, and the ledgers never count fewer files than there are."""
    root = tmp_path / "root"
    engines = [_start_bound_engine(root, seed, seconds=5.0) for seed in range(3)]
    for proc in engines:
        _go(proc)
    time.sleep(random.uniform(0.8, 2.0))
    victim = engines.pop()
    os.kill(victim.pid, signal.SIGKILL)
    victim.communicate(timeout=10)
    assert victim.returncode == -signal.SIGKILL
    restarted = _start_bound_engine(root, 2, seconds=2.0)
    _go(restarted)
    counters = [_counters(proc, timeout=120) for proc in [*engines, restarted]]
    print(f"counters after the kill: {counters}")
    for c in counters:
        assert c["wrong_bytes"] == 0 and c["corrupt"] == 0 and c["io_errors"] == 0, counters
        assert c["loads_ok"] > 0, counters
    ns_dir = next(p for p in root.iterdir() if p.is_dir() and len(p.name) == 32)
    files = len(value_files(ns_dir))
    assert files <= BOUND_FILES
    assert _ledger_sum(ns_dir) >= files, "a crash may only make the count too high (the bound stricter)"
    assert verify_root(root).corrupt == 0
    # the next engine alone corrects the drift the kill may have left
    alone = make_tier(root, AlignedRows(2, BB).rows, BB, max_bytes=BOUND_FILES * ENTRY)
    try:
        assert alone.usage().used_bytes == files * ENTRY
    finally:
        alone.shutdown()
    assert _ledger_sum(ns_dir) == files


def test_an_oversized_planted_segment_is_never_read(tmp_path: Path, rows: np.ndarray) -> None:
    """Regression (review, 2026-12-02): a sparse 1 GiB file named like another engine's journal
    segment was parsed to its end (seconds of an I/O thread; a shutdown missed its deadline)."""
    tier = make_tier(tmp_path, rows, BB)
    writer = JournalWriter(tier._dirs, "9-aaaaaaaaaaaa")
    reader = JournalReader(tier._dirs, "8-eeeeeeeeeeee")
    planted = tier.ns_dir / JOURNAL_DIR / "4242-abcdefabcdef.1"
    try:
        with open(planted, "wb") as f:
            f.truncate(1 << 30)
        key = key_of(1, b"planted")
        writer.append(ADDED, [key])
        writer.flush()
        started = time.monotonic()
        assert [k for _, _, k in reader.read()] == [key]
        assert time.monotonic() - started < 1.0
        assert reader.unsafe_entries == 1 and reader.bad_records == 0
        assert planted.stat().st_size == 1 << 30, "never deleted: not proven a journal of ours"
    finally:
        writer.close()
        reader.close()
        tier.shutdown()


def test_a_large_flush_reaches_a_caught_up_reader_whole(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One flush is one segment, even past SEGMENT_BYTES: split over segments, its rotations would
    delete its own first records before a reader that was caught up could read them."""
    monkeypatch.setattr(fs_journal, "SEGMENT_BYTES", 4 * RECORD_BYTES)
    tier = make_tier(tmp_path, rows, BB)
    writer = JournalWriter(tier._dirs, "9-dddddddddddd")
    reader = JournalReader(tier._dirs, "8-eeeeeeeeeeee")
    try:
        writer.append(ADDED, [key_of(1, b"one")])
        writer.flush()
        assert len(reader.read()) == 1  # caught up
        big = [key_of(i, b"big") for i in range(10)]
        writer.append(ADDED, big)  # one flush of 10 records, 2.5 segments' worth
        writer.flush()
        assert [k for _, _, k in reader.read()] == big
    finally:
        writer.close()
        reader.close()
        tier.shutdown()


def test_each_read_parses_a_bounded_share_and_takes_the_journals_in_turn(
    tmp_path: Path, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fs_journal, "READ_BUDGET", 20 * RECORD_BYTES)
    tier = make_tier(tmp_path, rows, BB)
    reader = JournalReader(tier._dirs, "8-eeeeeeeeeeee")
    writers = [JournalWriter(tier._dirs, f"9-{c * 12}") for c in "abc"]
    try:
        written = set()
        for n, writer in enumerate(writers):
            keys = [key_of(i, f"turn{n}".encode()) for i in range(50)]
            writer.append(ADDED, keys)
            writer.flush()
            written.update(keys)
        seen: list[bytes] = []
        per_call = []
        for _ in range(3):
            got = [k for _, _, k in reader.read()]
            per_call.append(len(got))
            seen += got
        assert per_call == [50, 50, 50], "one journal a call: the budget stops the rest"
        assert len(seen) == len(set(seen)) and set(seen) == written
        assert reader.read() == []
    finally:
        for writer in writers:
            writer.close()
        reader.close()
        tier.shutdown()
