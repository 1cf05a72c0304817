"""Every wait has an end, with real tiers under a real TieringManager (issue 20, class 10).

A tier keeps promising a block it cannot deliver: an fs root whose shard directory was replaced
after indexing (every read of it fails) or whose value file vanished, a redis-server stopped
(SIGSTOP) or killed (SIGKILL) in the middle of a load while the tier's existence cache still
says the block is there, an S3 server (a stub, and moto paused or killed mid-load) whose GETs
hang while the tier's index says the object exists, a memory tier whose I/O thread is stuck. In
each case a request's wait on the block ends as a MISS at ``wait_timeout``, and once the load
failed the block is a MISS at once (not HIT_PENDING again): the manager does not believe the
tier for ``failed_load_seconds``, and the redis and S3 tiers check the block again (EXISTS,
HEAD: a RETRY, bounded by the same deadline) before they promise it again.
Without the manager's deadlines these waited for the tier's own I/O timeout, then started the
same failing load again on the next lookup (an S3 timeout: ~90 s of HIT_PENDING with defaults).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from s3_servers import MotoServer, S3Stub, s3_options

from kvtier.keys import BlockKey, KVGeometry, Namespace, prefix_keys
from kvtier.manager import TieringManager
from kvtier.primary import IN_FLIGHT
from kvtier.tiers.memory import MemoryTier
from kvtier.types import LookupResult, RequestContext
from tier_doubles import wait_for_answer

pytestmark = pytest.mark.usefixtures("shm_leak_check")

HIT, HIT_PENDING, MISS, RETRY = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS, LookupResult.RETRY
BLOCK_BYTES = 64 * 1024
NS = Namespace("test/waits", KVGeometry.from_block_bytes(BLOCK_BYTES))
WAIT = 0.5
HOLD = 30.0


@pytest.fixture
def make() -> Iterator[Callable[..., TieringManager]]:
    built: list[TieringManager] = []

    def factory(tier: dict[str, Any], hold: float = HOLD) -> TieringManager:
        mgr = TieringManager.create(namespace=NS, num_cpu_blocks=8, tiers=[tier], wait_timeout=WAIT,
                                    failed_load_seconds=hold, shutdown_timeout=30)  # fmt: skip
        built.append(mgr)
        return mgr

    yield factory
    for mgr in built:
        mgr.shutdown()


def keys(n: int, seed: int = 0) -> list[BlockKey]:
    return prefix_keys(np.arange(n * 4) + seed * 1000, 4)


def step(mgr: TieringManager) -> None:
    mgr.on_schedule_end()
    time.sleep(0.01)


def store_in_tier(mgr: TieringManager, ks: list[BlockKey], timeout: float = 20.0) -> None:
    """Store ``ks`` (device -> CPU -> the tier), wait until the tier has them, then reset the CPU
    tier: the blocks are in the secondary tier only."""
    result = mgr.prepare_store(ks, RequestContext("writer"))
    assert result is not None
    rows = mgr.rows
    for key, slot in zip(result.keys_to_store, result.slots, strict=True):
        rows[slot, :BLOCK_BYTES] = np.frombuffer(key * (BLOCK_BYTES // len(key)), dtype=np.uint8)
    del rows
    mgr.complete_store(result.keys_to_store, RequestContext("writer"))
    deadline = time.monotonic() + timeout
    while mgr.has_pending_work():
        assert time.monotonic() < deadline, "the cascade did not finish"
        step(mgr)
    mgr.reset_cache()


def wait_for(mgr: TieringManager, key: BlockKey, req: RequestContext, limit: float) -> tuple[LookupResult, float]:
    return wait_for_answer(mgr, key, req, limit)


def load_fails_then_miss(mgr: TieringManager, key: BlockKey, job_limit: float, withheld: bool = True) -> None:
    """The block's load never succeeds: the request's wait ends as a MISS at the deadline, and
    after the load failed a new request gets MISS at once, not HIT_PENDING again (``withheld``:
    because the manager does not believe the tier, which still claims the block)."""
    req = RequestContext("reader")
    assert mgr.lookup(key, req) is HIT_PENDING, "the tier promises the block"
    answer, waited = wait_for(mgr, key, req, limit=job_limit + 5)
    assert answer is MISS and waited < WAIT + 0.5, f"{answer} after {waited:.2f}s"
    deadline = time.monotonic() + job_limit
    while mgr.primary.ref_count(key) == IN_FLIGHT:  # the failing load is reported, in its time
        assert time.monotonic() < deadline, "the tier never reported the load"
        step(mgr)
    for _ in range(5):
        step(mgr)
        assert mgr.lookup(key, RequestContext("next")) is MISS, "a failed block is promised again"
    assert (mgr.stats().tier(mgr.tier_label(1)).failures.get("withheld", 0) >= 5) is withheld


def test_fs_tier_whose_shard_became_unreadable(make: Callable[..., TieringManager], tmp_path: Path) -> None:
    mgr = make({"type": "fs", "root": str(tmp_path / "root"), "max_bytes": 64 << 20, "direct_io": False})
    key = keys(1)[0]
    store_in_tier(mgr, [key])
    (shard,) = [p for p in (tmp_path / "root").rglob(f"{key[0]:02x}") if p.is_dir()]
    shard.rename(shard.with_name("moved-away"))
    shard.write_bytes(b"not a directory")  # every read in this shard now fails (ENOTDIR)
    load_fails_then_miss(mgr, key, job_limit=10)


def never_promised(mgr: TieringManager, key: BlockKey, seconds: float) -> list[LookupResult]:
    """For ``seconds`` of engine steps, a request asking for ``key`` every step is never promised
    it (no HIT_PENDING, no HIT) and never waits on it (RETRY in a row) longer than the deadline;
    returns the answers seen."""
    answers: list[LookupResult] = []
    waiting_since: float | None = None
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        answer = mgr.lookup(key, RequestContext("asker"))
        now = time.monotonic()
        answers.append(answer)
        assert answer is MISS or answer is RETRY, f"{answer} after the load failed: the block is promised again"
        if answer is RETRY:
            waiting_since = now if waiting_since is None else waiting_since
            assert now - waiting_since < WAIT + 0.5, f"RETRY for {now - waiting_since:.2f}s"
        else:
            waiting_since = None
        step(mgr)
    return answers


def test_fs_tier_whose_value_file_vanished(make: Callable[..., TieringManager], tmp_path: Path) -> None:
    """Someone removed the value file after the tier indexed it: the load fails, the tier forgets
    the block itself, and it is a MISS from then on (a guard: the fs tier did this already)."""
    mgr = make({"type": "fs", "root": str(tmp_path / "root"), "max_bytes": 64 << 20, "direct_io": False})
    key = keys(1)[0]
    store_in_tier(mgr, [key])
    (value,) = [p for p in (tmp_path / "root").rglob("*") if p.is_file() and key.hex() in p.name]
    value.unlink()
    load_fails_then_miss(mgr, key, job_limit=10, withheld=False)
    never_promised(mgr, key, 0.5)
    assert mgr.stats().tier(mgr.tier_label(1)).extra["vanished"] == 1


def test_fs_tier_whose_value_was_corrupted_after_indexing(make: Callable[..., TieringManager], tmp_path: Path) -> None:
    """The fs tier forgets a corrupt value itself; the manager's answer is a MISS either way and
    never the corrupt bytes."""
    mgr = make({"type": "fs", "root": str(tmp_path / "root"), "max_bytes": 64 << 20, "direct_io": False})
    key = keys(1)[0]
    store_in_tier(mgr, [key])
    (value,) = [p for p in (tmp_path / "root").rglob("*") if p.is_file() and key.hex() in p.name]
    with open(value, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\xff" * 100)
    load_fails_then_miss(mgr, key, job_limit=10, withheld=False)


def stall_io(tier: MemoryTier) -> threading.Event:
    """Make the memory tier's I/O threads wait, before each work item, until the returned event
    is set (a thread stuck in its medium)."""
    go = threading.Event()
    run = tier._run

    def stalled(work: Any, local: Any) -> None:
        go.wait(30)
        run(work, local)

    tier._run = stalled  # type: ignore[method-assign]
    return go


def test_memory_tier_whose_io_thread_is_stuck(make: Callable[..., TieringManager]) -> None:
    mgr = make({"type": "memory", "max_bytes": 16 << 20})
    tier = mgr.tiers[0]
    assert isinstance(tier, MemoryTier)
    key, other = keys(2)
    store_in_tier(mgr, [key, other])
    req = RequestContext("reader")
    go = stall_io(tier)
    try:
        assert mgr.lookup(key, req) is HIT_PENDING
        answer, waited = wait_for(mgr, key, req, limit=10)
        assert answer is MISS and waited < WAIT + 0.5, f"{answer} after {waited:.2f}s"
        step(mgr)
        step(mgr)
        assert mgr.lookup(other, req) is MISS, "a tier whose job is overdue is not asked (no new wait)"
    finally:
        go.set()
    deadline = time.monotonic() + 10
    while mgr.lookup(key, req) is not HIT:  # the stuck load ends: the block arrives after all
        assert time.monotonic() < deadline
        step(mgr)
    assert wait_for(mgr, other, req, limit=10)[0] is HIT, "the tier serves again once it reported"


def test_redis_server_stopped_mid_load(make: Callable[..., TieringManager], redis_server: Any) -> None:
    options = {"type": "redis", "url": redis_server.url, "socket_timeout": 2.0, "connect_timeout": 1.0,
               "lookup_cache_seconds": 120.0, "failure_threshold": 1000}  # fmt: skip
    mgr = make(options)
    key = keys(1)[0]
    store_in_tier(mgr, [key])
    redis_server.pause()  # SIGSTOP: connections are accepted, nothing answers
    try:
        load_fails_then_miss(mgr, key, job_limit=15)
    finally:
        redis_server.resume()


def test_s3_server_whose_reads_hang(make: Callable[..., TieringManager], s3_stub: S3Stub) -> None:
    options = s3_options(s3_stub.endpoint, s3_stub.bucket, request_timeout=1.0, connect_timeout=0.5,
                         job_timeout=2.0, max_retries=0, failure_threshold=1000, max_in_flight=4)  # fmt: skip
    mgr = make(options)
    key = keys(1)[0]
    store_in_tier(mgr, [key])
    s3_stub.hang()
    try:
        load_fails_then_miss(mgr, key, job_limit=15)
    finally:
        s3_stub.release()


def test_a_wait_ends_even_when_the_engine_steps_slowly(make: Callable[..., TieringManager]) -> None:
    """Steps far apart (a long prefill): the wait is measured in seconds, not steps."""
    mgr = make({"type": "memory", "max_bytes": 16 << 20})
    tier = mgr.tiers[0]
    assert isinstance(tier, MemoryTier)
    key = keys(1)[0]
    store_in_tier(mgr, [key])
    req = RequestContext("reader")
    go = stall_io(tier)
    try:
        assert mgr.lookup(key, req) is HIT_PENDING
        mgr.on_schedule_end()
        time.sleep(WAIT * 0.6)
        assert mgr.lookup(key, req) is HIT_PENDING
        mgr.on_schedule_end()
        time.sleep(WAIT * 0.6)
        assert mgr.lookup(key, req) is MISS
    finally:
        go.set()


@pytest.mark.slow
def test_redis_server_killed_mid_load_and_restarted_empty(
    make: Callable[..., TieringManager], redis_server: Any
) -> None:
    """The server dies while a load is in flight and comes back empty on the same port. The
    tier's existence cache still says the block is there (120 s), but after the failed load it
    is not promised again: the manager holds it back for ``failed_load_seconds`` and the tier
    checks it again (EXISTS: absent) before it would promise it. A store of the block makes it a
    HIT again."""
    options = {"type": "redis", "url": redis_server.url, "socket_timeout": 3.0, "connect_timeout": 1.0,
               "lookup_cache_seconds": 120.0, "failure_threshold": 1000}  # fmt: skip
    mgr = make(options, hold=1.0)
    key = keys(1)[0]
    store_in_tier(mgr, [key])
    redis_server.pause()
    req = RequestContext("reader")
    loads = mgr.tiers[0].stats.loads_submitted
    assert mgr.lookup(key, req) is HIT_PENDING, "the tier promises the block"
    step(mgr)
    redis_server.kill()  # mid-load: the GET's connection is reset
    answer, waited = wait_for(mgr, key, req, limit=10)
    assert answer is MISS and waited < WAIT + 0.5, f"{answer} after {waited:.2f}s"
    assert mgr.tiers[0].stats.loads_submitted == loads + 1, "the block was promised (and loaded) again"
    redis_server.start()  # same port, empty
    deadline = time.monotonic() + 10
    while mgr.primary.ref_count(key) == IN_FLIGHT:
        assert time.monotonic() < deadline, "the tier never reported the load"
        step(mgr)
    checks = mgr.tiers[0].stats.lookups_retry
    never_promised(mgr, key, 2.5)  # past the manager's hold: the tier's own answer
    assert mgr.tiers[0].stats.lookups_retry > checks, "the tier checked the block again"
    store_in_tier(mgr, [key])
    assert wait_for(mgr, key, RequestContext("later"), limit=10)[0] is HIT


def test_redis_reset_cache_is_bounded_while_a_load_hangs(
    make: Callable[..., TieringManager], redis_server: Any
) -> None:
    """A load in flight on a stopped server: ``reset_cache(drain_timeout)`` ends within its
    deadline (plus the manager's grace) with TierDrainTimeout, resetting nothing; once the server
    answers again it resets."""
    from kvtier.errors import TierDrainTimeout

    options = {"type": "redis", "url": redis_server.url, "socket_timeout": 5.0, "connect_timeout": 1.0,
               "lookup_cache_seconds": 120.0, "failure_threshold": 1000}  # fmt: skip
    mgr = make(options)
    key = keys(1)[0]
    store_in_tier(mgr, [key])
    redis_server.pause()
    try:
        assert mgr.lookup(key, RequestContext("reader")) is HIT_PENDING
        step(mgr)
        start = time.monotonic()
        with pytest.raises(TierDrainTimeout):
            mgr.reset_cache(drain_timeout=0.5)
        assert time.monotonic() - start < 0.5 + 1.0 + 0.5
    finally:
        redis_server.resume()
    mgr.reset_cache(drain_timeout=10)
    assert not mgr.has_pending_work()


def s3_on_moto(moto: MotoServer, bucket: str) -> dict[str, Any]:
    """An S3 tier on ``moto`` whose requests outlast the wait deadline (3 s) and whose outage
    does not take it out of service (so only the deadlines end the waits)."""
    return s3_options(moto.endpoint, bucket, request_timeout=3.0, connect_timeout=0.5, job_timeout=5.0,
                      max_retries=0, check_timeout=2.0, miss_seconds=0.5, failure_threshold=1000,
                      open_seconds=0.5, max_in_flight=8)  # fmt: skip


@pytest.mark.slow
def test_s3_on_moto_paused_mid_load(make: Callable[..., TieringManager], own_moto: MotoServer) -> None:
    """moto stops answering while a GET is in flight (the tier's index says the object exists
    for an hour): the request's wait ends as a MISS at the deadline; after the GET timed out the
    block is never promised while the server is down (the manager holds it back, then the tier
    checks it again with a HEAD, which fails: RETRY within the deadline, then MISS); once the
    server answers, the block is checked, found and loaded."""
    bucket = own_moto.create_bucket()
    mgr = make(s3_on_moto(own_moto, bucket), hold=1.0)
    key = keys(1)[0]
    store_in_tier(mgr, [key])
    tier = mgr.tiers[0]
    own_moto.pause()
    try:
        load_fails_then_miss(mgr, key, job_limit=10)
        checks = tier.stats.lookups_retry
        never_promised(mgr, key, 3.0)  # past the manager's hold: the tier's own answer
    finally:
        own_moto.resume()
    req = RequestContext("after")
    seen: list[LookupResult] = []
    deadline = time.monotonic() + 15
    while not seen or seen[-1] is not HIT:
        assert time.monotonic() < deadline, f"never loaded again: {seen[-5:]}"
        seen.append(mgr.lookup(key, req))
        if seen[-1] is HIT_PENDING and seen.count(HIT_PENDING) == 1:
            assert tier.stats.lookups_retry > checks, "promised again before the tier checked it again"
        step(mgr)
    slot = mgr.primary.slot_of(key)
    assert slot is not None
    expected = np.frombuffer(key * (BLOCK_BYTES // len(key)), dtype=np.uint8)
    assert np.array_equal(mgr.rows[slot, :BLOCK_BYTES], expected), "the bytes loaded are the block's"


@pytest.mark.slow
def test_s3_on_moto_killed_mid_load(make: Callable[..., TieringManager], own_moto: MotoServer) -> None:
    """moto is killed while a GET is in flight and comes back empty (the bucket recreated): the
    block is a MISS at once and never promised again (the tier's HEAD finds it absent)."""
    bucket = own_moto.create_bucket()
    mgr = make(s3_on_moto(own_moto, bucket), hold=1.0)
    key = keys(1)[0]
    store_in_tier(mgr, [key])
    own_moto.pause()
    req = RequestContext("reader")
    loads = mgr.tiers[0].stats.loads_submitted
    assert mgr.lookup(key, req) is HIT_PENDING
    step(mgr)
    own_moto.kill()
    answer, waited = wait_for(mgr, key, req, limit=10)
    assert answer is MISS and waited < WAIT + 0.5, f"{answer} after {waited:.2f}s"
    assert mgr.tiers[0].stats.loads_submitted == loads + 1, "the block was promised (and loaded) again"
    own_moto.start()
    own_moto.create_bucket(bucket)
    deadline = time.monotonic() + 10
    while mgr.primary.ref_count(key) == IN_FLIGHT:
        assert time.monotonic() < deadline, "the tier never reported the load"
        step(mgr)
    never_promised(mgr, key, 3.0)
    assert mgr.tiers[0].stats.loads_submitted == loads + 1, "the block was promised (and loaded) again"


def test_s3_on_moto_a_second_engine_checking_a_paused_server(
    make: Callable[..., TieringManager], own_moto: MotoServer
) -> None:
    """A second engine (its own tier, empty index) asks for a block while moto does not answer:
    its existence check (RETRY) is cut at the wait deadline, not at the tier's check timeout."""
    bucket = own_moto.create_bucket()
    writer = make(s3_on_moto(own_moto, bucket))
    key = keys(1)[0]
    store_in_tier(writer, [key])
    reader = make(s3_on_moto(own_moto, bucket))
    deadline = time.monotonic() + 10
    while not reader.tiers[0].describe()["ready"]:  # its manifest check is done
        assert time.monotonic() < deadline
        time.sleep(0.05)
    own_moto.pause()
    try:
        req = RequestContext("reader")
        assert reader.lookup(key, req) is RETRY
        answer, waited = wait_for(reader, key, req, limit=10)
        assert answer is MISS and waited < WAIT + 0.5, f"{answer} after {waited:.2f}s"
        assert reader.stats().tier(reader.tier_label(1)).failures.get("retry_expired") == 1
    finally:
        own_moto.resume()
