"""The S3 tier's own behaviour (the shared contract runs in test_conformance.py).

Real servers: moto in its own process (layout, manifest, two engine processes
sharing a bucket, a server killed and restarted empty) and a stdlib stub for
what moto cannot do (503 SlowDown, hangs, truncated bodies, wrong lengths and
headers, request counting).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from s3_servers import FAST_FAILURE, MotoServer, S3Stub, put_plain, raw_client, s3_options

from kvtier.config import describe_config, load_config
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey, KVGeometry, Namespace, chain_ids
from kvtier.testing import SCHEDULER_CALL_LIMIT, make_namespace, new_job, resolve, run_job, wait_results
from kvtier.tiers.base import HealthState, JobResult, TierContext
from kvtier.tiers.format import FORMAT_VERSION, HEADER_SIZE, MAX_KEY_BYTES
from kvtier.tiers.registry import create_tier
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.s3_store import S3TierOptions, classify_error, key_of_path, manifest_dict, object_path
from kvtier.types import LookupResult, RequestContext

pytestmark = pytest.mark.s3

BLOCK = 64 * 1024
VALUE = HEADER_SIZE + BLOCK
FAST = FAST_FAILURE


@pytest.fixture
def make() -> Iterator[Callable[..., tuple[S3Tier, np.ndarray]]]:
    made: list[S3Tier] = []

    def build(endpoint: str, bucket: str, ns: Namespace | None = None, seed: int = 0, **options: Any) -> Any:
        rows = np.random.default_rng(seed).integers(0, 256, (32, BLOCK), dtype=np.uint8)
        ctx = TierContext(rows, BLOCK, ns or make_namespace(BLOCK))
        options = {"max_in_flight": 4, **options}
        opts = {k: v for k, v in s3_options(endpoint, bucket, **options).items() if k != "type"}
        tier = S3Tier(ctx, **opts)
        made.append(tier)
        return tier, rows

    yield build
    for tier in made:
        tier.shutdown()


def wait_ready(tier: S3Tier, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not tier.describe()["ready"]:
        assert time.monotonic() < deadline, f"tier never ready: {tier.health()}"
        tier.lookup(b"\0" * 32, None)
        time.sleep(0.01)
    # A lookup made just as the tier became ready queued a check of its key: send it now, so the
    # test's own step sends only the test's keys (some tests count HEADs exactly).
    tier.on_schedule_end()
    while tier.has_pending_work():
        assert time.monotonic() < deadline + 10, "the tier kept work pending after it became ready"
        time.sleep(0.01)


# --- moto: layout, manifest, processes, restarts ------------------------------------------------


def test_layout_manifest_and_value_format(s3_bucket: tuple[MotoServer, str], make: Any) -> None:
    import obstore as obs

    server, bucket = s3_bucket
    ns = make_namespace(BLOCK)
    tier, rows = make(server.endpoint, bucket, ns, prefix="team/kv")
    keys = chain_ids(range(2), ns)
    assert run_job(tier, keys, [0, 1], False, 20).success
    raw = raw_client(server.endpoint, bucket)
    listed = {m["path"]: m["size"] for batch in obs.list(raw, prefix="team/kv") for m in batch}
    ns_prefix = f"team/kv/{ns.hexdigest}"
    expected = {f"{ns_prefix}/{k.hex()[:2]}/{k.hex()}": VALUE for k in keys}
    assert {p: s for p, s in listed.items() if not p.endswith("manifest.json")} == expected
    for key in keys:
        assert key_of_path(ns_prefix, tier.object_path(key)) == key
    manifest = json.loads(bytes(obs.get(raw, f"{ns_prefix}/manifest.json").bytes()))
    assert manifest["block_bytes"] == BLOCK and manifest["namespace_digest"] == ns.hexdigest
    assert manifest["namespace"]["model_id"] == ns.model_id and manifest["header_bytes"] == HEADER_SIZE
    body = bytes(obs.get(raw, tier.object_path(keys[1])).bytes())
    assert body[:8] == b"KVTIER\x00\x01" and body[HEADER_SIZE:] == rows[1].tobytes()
    assert tier.usage().used_bytes == 2 * VALUE and tier.usage().capacity_bytes is None


def test_a_manifest_of_another_block_size_keeps_the_tier_out_of_service(
    s3_bucket: tuple[MotoServer, str], make: Any
) -> None:
    import obstore as obs

    server, bucket = s3_bucket
    ns = make_namespace(BLOCK)
    raw = raw_client(server.endpoint, bucket)
    foreign = {**manifest_dict(ns.digest, ns.canonical(), BLOCK), "block_bytes": 4096}
    obs.put(raw, f"kvtier/{ns.hexdigest}/manifest.json", json.dumps(foreign).encode())
    tier, _ = make(server.endpoint, bucket, ns)
    keys = chain_ids(range(1), ns)
    job = new_job(keys, [0], False)
    tier.submit_store(job)
    result = wait_results(tier, {job.job_id}, 10)[job.job_id]
    assert not result.success
    health = tier.health()
    assert health.state is not HealthState.CLOSED and "block_bytes=4096" in health.detail
    assert tier.lookup(keys[0], None) is LookupResult.MISS
    assert [m["path"] for batch in obs.list(raw, prefix="kvtier") for m in batch] == [
        f"kvtier/{ns.hexdigest}/manifest.json"
    ], "nothing may be written next to a foreign manifest"


def test_a_format_1_manifest_is_rewritten_to_the_current_format_and_its_blocks_served(
    s3_bucket: tuple[MotoServer, str], make: Any
) -> None:
    """Regression (2026-12-04): the S3 tier refused a namespace whose manifest names value format 1
    (which this release reads, and the fs tier takes and rewrites), while inspect called it usable."""
    import obstore as obs

    server, bucket = s3_bucket
    ns = make_namespace(BLOCK)
    writer, rows = make(server.endpoint, bucket, ns)
    keys = chain_ids(range(2), ns)
    assert run_job(writer, keys, [0, 1], False, 20).success
    writer.shutdown()
    raw, path, planted = _plant_format_1_manifest(server, bucket, ns)
    older = json.loads(planted)
    reader, reader_rows = make(server.endpoint, bucket, ns, seed=1)
    assert run_job(reader, keys, [4, 5], True, 20).success
    assert np.array_equal(reader_rows[4:6], rows[0:2])
    assert reader.health().state is HealthState.CLOSED
    assert json.loads(bytes(obs.get(raw, path).bytes())) == {**older, "value_format_version": FORMAT_VERSION}


def _plant_format_1_manifest(server: MotoServer, bucket: str, ns: Namespace, **changes: Any) -> tuple[Any, str, bytes]:
    """Put ``ns``'s manifest as a format-1 release wrote it (``changes`` on top); returns a raw
    client, the manifest's path and the bytes put."""
    import obstore as obs

    raw = raw_client(server.endpoint, bucket)
    path = f"kvtier/{ns.hexdigest}/manifest.json"
    body = json.dumps({**manifest_dict(ns.digest, ns.canonical(), BLOCK), "value_format_version": 1, **changes})
    obs.put(raw, path, body.encode())
    return raw, path, body.encode()


def test_a_create_only_tier_takes_a_format_1_manifest_as_it_is(s3_bucket: tuple[MotoServer, str], make: Any) -> None:
    """create_only never overwrites, the manifest included: the namespace is served, the manifest kept."""
    import obstore as obs

    server, bucket = s3_bucket
    ns = make_namespace(BLOCK)
    raw, path, planted = _plant_format_1_manifest(server, bucket, ns)
    tier, _ = make(server.endpoint, bucket, ns, create_only=True)
    assert run_job(tier, chain_ids(range(1), ns), [0], False, 20).success
    assert bytes(obs.get(raw, path).bytes()) == planted


def test_a_format_1_manifest_replaced_before_its_rewrite_is_never_overwritten(
    s3_bucket: tuple[MotoServer, str], make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review (2026-12-04): the rewrite was a plain PUT made after the GET; a manifest another engine
    (another block size) put in between was overwritten, and that engine's blocks then read as
    corrupt and deleted. The rewrite is conditional on the ETag read: it is refused, the manifest
    is read again and this engine refuses the namespace."""
    import obstore as obs

    server, bucket = s3_bucket
    ns = make_namespace(BLOCK)
    raw, path, _ = _plant_format_1_manifest(server, bucket, ns)
    theirs = json.dumps({**manifest_dict(ns.digest, ns.canonical(), BLOCK), "block_bytes": 2 * BLOCK}).encode()
    real_put = obs.put

    def put(store: Any, where: str, body: Any, **kwargs: Any) -> Any:
        if where == path and isinstance(kwargs.get("mode"), dict):  # the rewrite: another engine first
            real_put(raw, path, theirs)
        return real_put(store, where, body, **kwargs)

    monkeypatch.setattr(obs, "put", put)
    tier, _ = make(server.endpoint, bucket, ns)
    job = new_job(chain_ids(range(1), ns), [0], False)
    tier.submit_store(job)
    assert not wait_results(tier, {job.job_id}, 10)[job.job_id].success
    assert f"block_bytes={2 * BLOCK}" in tier.health().detail, tier.health().detail
    assert bytes(obs.get(raw, path).bytes()) == theirs


def test_a_format_1_manifest_that_reads_back_unchanged_is_taken_after_one_rewrite(
    s3_bucket: tuple[MotoServer, str], make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review (2026-12-04): a store whose reads lag its writes (a cache in front) made the tier PUT
    the manifest three times and then report it 'appeared and vanished'. One rewrite; then the
    namespace is served under the manifest as read."""
    import obstore as obs

    server, bucket = s3_bucket
    ns = make_namespace(BLOCK)
    raw, path, planted = _plant_format_1_manifest(server, bucket, ns)
    real_put = obs.put
    rewrites: list[str] = []

    def put(store: Any, where: str, body: Any, **kwargs: Any) -> Any:
        if where == path and isinstance(kwargs.get("mode"), dict):  # acknowledged, never seen by reads
            rewrites.append(where)
            return {"e_tag": None, "version": None}
        return real_put(store, where, body, **kwargs)

    monkeypatch.setattr(obs, "put", put)
    tier, _ = make(server.endpoint, bucket, ns)
    assert run_job(tier, chain_ids(range(1), ns), [0], False, 20).success
    assert len(rewrites) == 1 and tier.health().state is HealthState.CLOSED
    assert bytes(obs.get(raw, path).bytes()) == planted


@pytest.mark.parametrize("refusal", [(501, "NotImplemented"), (403, "AccessDenied"), (400, "InvalidArgument")])
def test_a_format_1_manifest_whose_rewrite_is_refused_is_taken_as_it_is(
    s3_stub: S3Stub, make: Any, refusal: tuple[int, str]
) -> None:
    """Review (2026-12-04): a store that refused the rewrite's If-Match with anything but 501 kept
    the tier out of service for a namespace it reads; the rewrite is optional."""
    ns = make_namespace(BLOCK)
    path = f"kvtier/{ns.hexdigest}/manifest.json"
    planted = json.dumps({**manifest_dict(ns.digest, ns.canonical(), BLOCK), "value_format_version": 1}).encode()
    s3_stub.objects[s3_stub.object_key(path)] = planted
    s3_stub.if_match_refused = refusal
    tier, _ = make(s3_stub.endpoint, s3_stub.bucket, ns)
    assert run_job(tier, chain_ids(range(1), ns), [0], False, 20).success
    assert tier.health().state is HealthState.CLOSED
    assert s3_stub.objects[s3_stub.object_key(path)] == planted


@pytest.mark.parametrize("changes", [{"value_format_version": 3}, {"value_format_version": True},
                                     {"value_format_version": 1, "block_bytes": 4096}])  # fmt: skip
def test_a_manifest_of_a_format_this_release_cannot_read_is_refused_untouched(
    s3_bucket: tuple[MotoServer, str], make: Any, changes: dict[str, Any]
) -> None:
    import obstore as obs

    server, bucket = s3_bucket
    ns = make_namespace(BLOCK)
    raw, path, planted = _plant_format_1_manifest(server, bucket, ns, **changes)
    tier, _ = make(server.endpoint, bucket, ns)
    (key,) = chain_ids(range(1), ns)
    job = new_job([key], [0], False)
    tier.submit_store(job)
    assert not wait_results(tier, {job.job_id}, 10)[job.job_id].success
    field = "block_bytes=4096" if "block_bytes" in changes else "value_format_version="
    assert field in tier.health().detail, tier.health().detail
    assert bytes(obs.get(raw, path).bytes()) == planted, "a manifest it cannot take is never rewritten"


def test_a_deeply_nested_planted_manifest_is_named_unreadable(s3_bucket: tuple[MotoServer, str], make: Any) -> None:
    """Review U3: 30,000 nested arrays (under the size limit) gave a bare RecursionError."""
    import obstore as obs

    server, bucket = s3_bucket
    ns = make_namespace(BLOCK)
    raw = raw_client(server.endpoint, bucket)
    obs.put(raw, f"kvtier/{ns.hexdigest}/manifest.json", b"[" * 30000 + b"]" * 30000)
    tier, _ = make(server.endpoint, bucket, ns)
    job = new_job(chain_ids(range(1), ns), [0], False)
    tier.submit_store(job)
    assert not wait_results(tier, {job.job_id}, 10)[job.job_id].success
    detail = tier.health().detail
    assert "manifest.json unreadable (manifest is nested too deeply" in detail and "Recursion" not in detail, detail



def test_a_planted_manifest_whose_get_understates_its_size_is_never_read_whole(
    s3_bucket: tuple[MotoServer, str], make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review S3 (left alone by the inspect fix): the engine's manifest check compared the size the
    GET answered with the limit, then read the body whole: a server (or a proxy) answering a small
    size for a huge object made it hold all of it. Its body is now streamed no further than the
    limit."""
    import obstore as obs

    from kvtier.tiers.s3_store import MAX_MANIFEST_BYTES

    server, bucket = s3_bucket
    ns = make_namespace(BLOCK)
    raw = raw_client(server.endpoint, bucket)
    manifest = f"kvtier/{ns.hexdigest}/manifest.json"
    obs.put(raw, manifest, b"{" * (16 * MAX_MANIFEST_BYTES))
    real_get = obs.get
    streamed = [0]

    class Understated:  # the GET's answer claims 100 bytes; the body is what the object holds
        def __init__(self, result: Any) -> None:
            self.real, self.meta = result, dict(result.meta, size=100)

        def bytes(self) -> Any:
            raise AssertionError("the manifest was read whole")

        def stream(self, min_chunk_size: int = 1 << 20) -> Any:
            for chunk in self.real.stream(min_chunk_size=4096):
                for at in range(0, len(chunk), 4096):
                    streamed[0] += len(chunk[at : at + 4096])
                    yield bytes(memoryview(chunk)[at : at + 4096])

    def get(store: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        result = real_get(store, path, *args, **kwargs)
        return Understated(result) if path == manifest else result

    monkeypatch.setattr(obs, "get", get)
    tier, _ = make(server.endpoint, bucket, ns)
    job = new_job(chain_ids(range(1), ns), [0], False)
    tier.submit_store(job)
    assert not wait_results(tier, {job.job_id}, 10)[job.job_id].success
    assert "more than a manifest holds" in tier.health().detail, tier.health().detail
    assert 0 < streamed[0] <= MAX_MANIFEST_BYTES + 4096, streamed

@pytest.mark.slow
def test_two_engine_processes_share_a_bucket_and_namespaces_never_mix(
    s3_bucket: tuple[MotoServer, str], private_shm: Path
) -> None:
    server, bucket = s3_bucket
    child = Path(__file__).with_name("s3_child.py")

    def run(mode: str, model: str) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, str(child), mode, server.endpoint, bucket, model, "6", str(private_shm)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))

    assert run("store", "model-shared")["cascaded"] == 6
    loaded = run("load", "model-shared")
    assert loaded["answers"] == ["hit"] * 6 and loaded["byte_exact"] is True
    other = run("load", "model-other")
    assert other["answers"][0] == "miss" and "byte_exact" not in other


@pytest.mark.slow
def test_engine_processes_exit_cleanly_while_their_last_checks_answer(
    s3_bucket: tuple[MotoServer, str], private_shm: Path
) -> None:
    """Regression: a process whose last HEADs answered as it exited aborted (SIGABRT, ~1 exit in 15)
    when the checks used obstore's async calls; every exit here must be clean."""
    server, bucket = s3_bucket
    child = Path(__file__).with_name("s3_child.py")

    def start(mode: str, model: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, str(child), mode, server.endpoint, bucket, model, "6", str(private_shm)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    stored = start("store", "model-exit")
    assert stored.wait(120) == 0, stored.communicate()[1][-3000:]
    for _ in range(8):
        # a model with nothing stored: the first key answers MISS and the process exits while the
        # HEADs of the rest of its chain are still out or answering
        batch = [start("load", f"model-absent-{i}") for i in range(4)]
        for proc in batch:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"exit status {proc.returncode}: {err[-3000:]}"
            assert json.loads(out.strip().splitlines()[-1])["answers"][0] == "miss"


@pytest.mark.slow
def test_server_killed_and_restarted_empty_mid_run(own_moto: MotoServer, make: Any) -> None:
    bucket = own_moto.create_bucket()
    ns = make_namespace(BLOCK)
    tier, rows = make(own_moto.endpoint, bucket, ns, **FAST)
    keys = chain_ids(range(16), ns)
    assert run_job(tier, keys[:8], list(range(8)), False, 20).success
    worst = 0.0
    results: dict[int, JobResult] = {}
    submitted: set[int] = set()

    def step(i: int) -> None:
        nonlocal worst
        t0 = time.perf_counter()
        tier.lookup(keys[8 + i % 8], None)
        store = new_job([keys[8 + i % 8]], [8 + i % 8], False)
        load = new_job(keys[:2], [20, 21], True)
        tier.submit_store(store)
        tier.submit_load(load)
        submitted.update((store.job_id, load.job_id))
        tier.on_schedule_end()
        results.update({r.job_id: r for r in tier.poll_finished()})
        worst = max(worst, time.perf_counter() - t0)

    for i in range(5):
        step(i)
    own_moto.kill()
    killed = time.monotonic()
    while time.monotonic() - killed < 2.0:
        step(0)
        time.sleep(0.02)
    assert tier.health().state is not HealthState.CLOSED
    own_moto.start()  # same port, empty: the operator's bucket comes back, its objects do not
    own_moto.create_bucket(bucket)
    deadline = time.monotonic() + 15
    while tier.health().state is not HealthState.CLOSED:
        assert time.monotonic() < deadline, f"tier did not recover: {tier.health()}"
        step(1)
        time.sleep(0.02)
    assert worst < SCHEDULER_CALL_LIMIT, f"a scheduler-side step took {worst * 1000:.1f} ms"
    results.update(wait_results(tier, submitted - set(results), 20))
    assert all(r.success or r.error for r in results.values())
    # the old objects are gone: loads MISS (and the index forgets them); stores resume
    lost = run_job(tier, keys[:2], [22, 23], True, 20)
    assert not lost.success and lost.succeeded(keys) == []
    assert resolve(tier, keys[0], 10) is LookupResult.MISS
    assert run_job(tier, keys[:2], [0, 1], False, 20).success
    back = run_job(tier, keys[:2], [24, 25], True, 20)
    assert back.success, back.error
    assert np.array_equal(rows[24:26], rows[0:2])


def test_a_server_down_from_the_start_never_blocks_and_stores_fail_cleanly(make: Any) -> None:
    from s3_servers import free_port

    tier, _ = make(f"http://127.0.0.1:{free_port()}", "kv-cache", **FAST)
    keys = chain_ids(range(2), tier.context.namespace)
    t0 = time.perf_counter()
    job = new_job(keys, [0, 1], False)
    tier.submit_store(job)
    assert time.perf_counter() - t0 < SCHEDULER_CALL_LIMIT
    result = wait_results(tier, {job.job_id}, 10)[job.job_id]
    assert not result.success and result.error
    assert resolve(tier, keys[0], 5) is LookupResult.MISS
    deadline = time.monotonic() + 5
    while tier.health().state is HealthState.CLOSED:
        assert time.monotonic() < deadline, "a refused connection must take the tier out of service"
        time.sleep(0.01)
    assert "connection refused" in tier.health().detail
    t0 = time.perf_counter()
    tier.shutdown()
    assert time.perf_counter() - t0 < 5


# --- the stub: batching, races, faults -------------------------------------------------------------


def test_existence_checks_go_out_once_per_step_and_stop_at_the_first_404(s3_stub: S3Stub, make: Any) -> None:
    ns = make_namespace(BLOCK)
    writer, _ = make(s3_stub.endpoint, s3_stub.bucket, ns)
    keys = chain_ids(range(20), ns)
    assert run_job(writer, keys[:3], [0, 1, 2], False, 10).success
    reader, _ = make(s3_stub.endpoint, s3_stub.bucket, ns)
    wait_ready(reader)
    heads_before = s3_stub.count("HEAD")
    req = RequestContext("chain")
    assert [reader.lookup(k, req) for k in keys] == [LookupResult.RETRY] * 20
    assert s3_stub.count("HEAD") == heads_before, "lookups must not do I/O"
    reader.on_schedule_end()
    deadline = time.monotonic() + 5
    while reader.has_pending_work():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    answers = [reader.lookup(k, req) for k in keys[:4]]
    assert answers == [LookupResult.HIT] * 3 + [LookupResult.MISS]
    heads = s3_stub.count("HEAD") - heads_before
    assert heads == 8, f"one window of 8 HEADs, then the chain stops at its first 404 (got {heads})"


def _checked(tier: Any, keys: list[BlockKey], req: RequestContext) -> list[LookupResult]:
    """Look ``keys`` up (unknown: RETRY), send their check at step end, wait for it; the answers after it."""
    assert [tier.lookup(k, req) for k in keys] == [LookupResult.RETRY] * len(keys)
    tier.on_schedule_end()
    deadline = time.monotonic() + 10
    while tier.has_pending_work():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return [tier.lookup(k, req) for k in keys]


def _check_with_a_lost_head(s3_stub: S3Stub, make: Any, fault: str, blocks: int, check_timeout: float) -> Any:
    """A reader's check of ``blocks`` stored keys whose first key's HEAD gets ``fault``: the
    answers after it, its duration, the HEADs it sent and the reader."""
    ns = make_namespace(BLOCK)
    writer, _ = make(s3_stub.endpoint, s3_stub.bucket, ns)
    keys = chain_ids(range(blocks), ns)
    assert run_job(writer, keys, list(range(blocks)), False, 10).success
    reader, _ = make(s3_stub.endpoint, s3_stub.bucket, ns, check_timeout=check_timeout, failure_threshold=1000)
    wait_ready(reader)
    s3_stub.fault(reader.object_path(keys[0]), fault)
    heads = s3_stub.count("HEAD")
    started = time.monotonic()
    answers = _checked(reader, keys, RequestContext("chain"))
    took = time.monotonic() - started
    s3_stub.release()
    return answers, took, s3_stub.count("HEAD") - heads, reader


@pytest.mark.parametrize("check_timeout", [2.0, 1.0])
def test_a_head_that_never_answers_is_hedged_within_the_checks_deadline(
    s3_stub: S3Stub, make: Any, check_timeout: float
) -> None:
    """Regression (CI of c35a97a, S3 fleet test): one HEAD lost on a loaded host (no answer) held
    its chain's first key until the whole check's deadline, then counted it absent: the engine
    recomputed a prefix the bucket held. A HEAD still out 40 % into ``check_timeout`` is sent a
    second time and the first answer wins."""
    answers, took, sent, reader = _check_with_a_lost_head(s3_stub, make, "stall_head", 3, check_timeout)
    assert answers == [LookupResult.HIT] * 3, "the lost HEAD's hedge answered"
    assert sent == 4 and reader.stats.extra["heads_hedged"] == 1
    assert reader.stats.extra["checks_failed"] == 0
    assert 0.4 * check_timeout <= took < check_timeout


def test_a_key_whose_head_and_hedge_are_both_lost_counts_absent_at_the_deadline(s3_stub: S3Stub, make: Any) -> None:
    """Every HEAD of the key lost: one hedge (not more), then at the check's deadline the key
    counts absent and the failure is counted (``checks_failed``, which the breaker hears of)."""
    answers, took, sent, reader = _check_with_a_lost_head(s3_stub, make, "stall_heads", 2, 1.0)
    assert answers[0] == LookupResult.MISS
    assert sent == 3 and reader.stats.extra["heads_hedged"] == 1
    assert reader.stats.extra["checks_failed"] == 1
    assert 1.0 <= took < 1.0 + 1.0


@pytest.mark.parametrize("max_in_flight", [4, 1])
def test_slow_existence_checks_never_pile_up_ahead_of_loads(s3_stub: S3Stub, make: Any, max_in_flight: int) -> None:
    """Review H1: with HEADs slower than the steps that need them, one queued batch per step grew
    without bound ahead of loads (served first), and a promotion was never reported. Now at most
    half the threads run checks, later steps' keys join one deferred batch, and stale keys are
    dropped unchecked. Review s3b #3: with max_in_flight 1 the one thread ran the deferred batch
    after every batch, never the load; now a batch goes out there only while no load waits."""
    from kvtier.tiers.jobs import Lane

    tier, _ = make(s3_stub.endpoint, s3_stub.bucket, check_timeout=1.0, failure_threshold=1000,
                   request_timeout=1.0, job_timeout=3.0, max_in_flight=max_in_flight)  # fmt: skip
    ns = tier.context.namespace
    stored = chain_ids(range(4), ns)
    assert run_job(tier, stored, [0, 1, 2, 3], False, 10).success
    s3_stub.delays["HEAD"] = 0.3  # 30 steps' time, and short of the hedge (40 % of check_timeout)
    load = new_job(stored, [10, 11, 12, 13], True)
    got: dict[int, JobResult] = {}
    t0 = time.monotonic()
    most_queued = step = 0
    while time.monotonic() - t0 < 5 and load.job_id not in got:
        for r in range(3):  # each step: 3 new prompts of 4 unknown keys
            first = 10_000 + step * 12 + r * 4
            for key in chain_ids(range(first, first + 4), ns):
                tier.lookup(key, RequestContext(f"r{step}-{r}"))
        tier.on_schedule_end()
        step += 1
        if step == 50:
            tier.submit_load(load)
            loaded_at = time.monotonic()
        got.update({r.job_id: r for r in tier.poll_finished()})
        most_queued = max(most_queued, tier._queue.queued(Lane.EXISTS))
        time.sleep(0.01)
    s3_stub.delays.clear()
    assert load.job_id in got, f"the load was not reported; {tier._queue.queued(Lane.EXISTS)} checks queued"
    assert got[load.job_id].success and time.monotonic() - loaded_at < 3.0
    assert most_queued <= 2, most_queued


def test_a_check_answered_after_a_store_does_not_override_it(s3_stub: S3Stub, make: Any) -> None:
    """Regression: a HEAD sent before a PUT finished answered 404 after it, and the key read MISS."""
    tier, _ = make(s3_stub.endpoint, s3_stub.bucket)
    wait_ready(tier)
    (key,) = chain_ids(range(1), tier.context.namespace)
    s3_stub.delays["HEAD"] = 0.3
    assert tier.lookup(key, None) is LookupResult.RETRY
    tier.on_schedule_end()  # the HEAD is now in flight, and will say 404
    time.sleep(0.05)
    assert run_job(tier, [key], [0], False, 10).success
    deadline = time.monotonic() + 5
    while tier.has_pending_work():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert tier.lookup(key, None) is LookupResult.HIT


def test_slowdown_is_retried_with_backoff_and_succeeds(s3_stub: S3Stub, make: Any) -> None:
    tier, rows = make(s3_stub.endpoint, s3_stub.bucket)
    wait_ready(tier)
    keys = chain_ids(range(2), tier.context.namespace)
    s3_stub.slowdowns = 2
    assert run_job(tier, keys, [0, 1], False, 10).success
    s3_stub.slowdowns = 2
    result = run_job(tier, keys, [4, 5], True, 10)
    assert result.success, result.error
    assert np.array_equal(rows[4:6], rows[0:2])
    assert tier.health().state is HealthState.CLOSED and tier.stats.stores_failed == 0
    assert s3_stub.count("PUT") >= 4 and s3_stub.count("GET") >= 4, "the 503s were retried"


def test_a_server_stalled_from_the_start_ends_store_jobs_and_shutdown_in_time(s3_stub: S3Stub) -> None:
    """Review H2: each I/O thread waiting on the manifest check ran the whole check again with full
    retries, one after another, so store jobs ended at several job_timeouts and shutdown() overran
    its bound; now a waiter takes the check's result, and stops waiting at shutdown."""
    s3_stub.hang()
    rows = np.zeros((8, BLOCK), dtype=np.uint8)
    ns = make_namespace(BLOCK)
    options = {k: v for k, v in s3_options(s3_stub.endpoint, s3_stub.bucket, max_in_flight=8).items() if k != "type"}
    tier = S3Tier(TierContext(rows, BLOCK, ns), **{**options, **FAST, "failure_threshold": 1000})
    keys = chain_ids(range(8), ns)
    jobs = [new_job([key], [i], False) for i, key in enumerate(keys)]
    t0 = time.monotonic()
    for job in jobs:
        tier.submit_store(job)
    results = wait_results(tier, {job.job_id for job in jobs}, 15)
    took = time.monotonic() - t0
    assert not any(r.success for r in results.values())
    assert took < FAST["job_timeout"] + FAST["request_timeout"] + 2.0, f"store jobs ended after {took:.1f}s"
    more = [new_job([key], [i], False) for i, key in enumerate(keys)]
    for job in more:
        tier.submit_store(job)
    time.sleep(0.2)
    t0 = time.monotonic()
    tier.shutdown()  # raises TierError past its bound (job_timeout + request_timeout + 2)
    assert time.monotonic() - t0 < FAST["job_timeout"] + FAST["request_timeout"] + 2.0


def test_work_started_late_in_a_job_gets_only_the_retries_that_fit_its_deadline(
    s3_stub: S3Stub, make: Any
) -> None:
    """Review H3: the retry budget was fixed (job_timeout - request_timeout), so work started just
    before the deadline ran a whole budget more: jobs ended up to 2 x job_timeout after
    submission. Now it is bounded by the time the job has left (at worst one request past it)."""
    tier, _ = make(s3_stub.endpoint, s3_stub.bucket, request_timeout=1.0, job_timeout=3.0, max_retries=4,
                   failure_threshold=1000)  # fmt: skip
    keys = chain_ids(range(9), tier.context.namespace)
    assert run_job(tier, keys[:1], [0], False, 10).success
    s3_stub.hang()
    job = new_job(keys[1:], list(range(1, 9)), False)  # 8 blocks on 3 store threads: waves
    t0 = time.monotonic()
    tier.submit_store(job)
    result = wait_results(tier, {job.job_id}, 15)[job.job_id]
    took = time.monotonic() - t0
    assert not result.success
    assert took < 3.0 + 1.0 * 0.6, f"a 3 s job with 1 s requests was reported after {took:.1f}s"


@pytest.mark.parametrize("max_retries", [4, 0])
def test_a_get_that_times_out_is_retried_within_the_jobs_deadline(s3_stub: S3Stub, make: Any, max_retries: int) -> None:
    """Regression (CI of 77244d3, fleet test): work taken up as soon as its job was submitted had a
    hair less than the full retry budget left and got the half-budget client, whose budget
    (0.45 s here, 10 s of the defaults' 20 s) a request timing out at ``request_timeout`` had
    used up: a GET that never answered failed its block instead of being retried. With the
    client's retries off (``max_retries: 0``, or work queued past the top of its job's budget)
    the tier sends it again itself while the job has a request's time left."""
    tier, rows = make(s3_stub.endpoint, s3_stub.bucket, request_timeout=0.5, job_timeout=1.4, max_retries=max_retries,
                      failure_threshold=1000)  # fmt: skip
    wait_ready(tier)
    keys = chain_ids(range(2), tier.context.namespace)
    assert run_job(tier, keys, [0, 1], False, 10).success
    s3_stub.fault(tier.object_path(keys[0]), "stall")
    gets = s3_stub.count("GET")
    result = run_job(tier, keys, [4, 5], True, 10)
    s3_stub.release()
    assert result.success, result.error
    assert np.array_equal(rows[4:6], rows[0:2])
    assert s3_stub.count("GET") == gets + 3, "the stalled GET, its retry and the other key's"
    assert tier.stats.extra["requests_retried"] == (1 if max_retries == 0 else 0)


@pytest.mark.parametrize("fault", ["stall", "stall_after_write"])
def test_a_create_only_upload_that_times_out_is_sent_again_within_the_deadline(
    s3_stub: S3Stub, make: Any, fault: str
) -> None:
    """Review (2026-12-04): the client never retries a conditional PUT (not idempotent), so a
    create_only upload that timed out failed its block however much of the job was left. The
    tier sends it again while the job has a request's time left; where the first one had landed,
    the second finds it, checks it is this block and counts it stored."""
    tier, rows = make(s3_stub.endpoint, s3_stub.bucket, create_only=True, request_timeout=0.5, job_timeout=3.0,
                      failure_threshold=1000)  # fmt: skip
    wait_ready(tier)
    (key,) = chain_ids(range(1), tier.context.namespace)
    s3_stub.fault(tier.object_path(key), fault)
    puts = s3_stub.count("PUT")
    result = run_job(tier, [key], [0], False, 10)
    s3_stub.release()
    assert result.success, result.error
    assert s3_stub.count("PUT") == puts + 2 and tier.stats.extra["requests_retried"] == 1
    assert tier.stats.extra.get("create_conflicts", 0) == 0
    assert run_job(tier, [key], [7], True, 10).success
    assert np.array_equal(rows[7], rows[0])


@pytest.mark.parametrize(("create_only", "found_by"), [(False, "housekeeping"), (True, "housekeeping"),
                                                     (False, "lookup"), (False, "load")])
def test_an_upload_that_timed_out_but_landed_is_found_and_announced(
    s3_stub: S3Stub, make: Any, create_only: bool, found_by: str
) -> None:
    """Regression (CI of 042910e, the fleet test on S3): under load a PUT timed out at the client
    after the server had written the object. The tier reported the block not stored and never
    announced it, so the fleet index lacked blocks the bucket held. An upload whose outcome is
    unknown is now checked: by housekeeping, on its own (the tier idle, its last request
    failed: review, a doubt must not wait for other traffic), or first by a lookup's HEAD or a
    load (review: those settled the doubt without announcing it). One that landed is announced
    once; one that never landed is forgotten, never announced."""
    tier, rows = make(s3_stub.endpoint, s3_stub.bucket, create_only=create_only, request_timeout=0.5,
                      job_timeout=0.8, max_retries=0, failure_threshold=1000)  # fmt: skip
    wait_ready(tier)
    landed, lost = chain_ids(range(2), tier.context.namespace)
    s3_stub.fault(tier.object_path(landed), "stall_after_write")
    s3_stub.fault(tier.object_path(lost), "stall")
    tier.take_events()
    result = run_job(tier, [landed, lost], [0, 1], False, 10)
    assert not result.success and "timed out" in (result.error or ""), result.error
    assert result.succeeded([landed, lost]) == []
    assert tier.stats.extra["writes_in_doubt"] == 2
    s3_stub.release()
    if found_by == "lookup":  # (at once: housekeeping checks a doubt request_timeout after it arose)
        assert resolve(tier, landed, 5) is LookupResult.HIT
    elif found_by == "load":
        assert run_job(tier, [landed], [5], True, 10).success

    def heads() -> list[str]:
        return [path for method, path in s3_stub.requests if method == "HEAD"]

    deadline = time.monotonic() + 10
    while not tier.holds(landed) or not any(tier.object_path(lost) in p for p in heads()):
        assert time.monotonic() < deadline, f"the uploads in doubt were not checked: {heads()}"
        time.sleep(0.02)
    time.sleep(1.2)  # (a further tick would announce again, or HEAD the settled keys again)
    announced = [e.keys for e in tier.take_events() if not e.removed]
    assert announced == [(landed,)]
    assert tier.held_keys() == [landed] and not tier.holds(lost)
    assert tier.stats.extra["uploads_found"] == 1 and tier.stats.extra["objects_written"] == 0
    assert tier.stats.extra["writes_in_doubt"] == 0
    assert sum(tier.object_path(landed) in p for p in heads()) == (0 if found_by == "load" else 1)
    assert sum(tier.object_path(lost) in p for p in heads()) == 1
    assert run_job(tier, [landed], [6], True, 10).success
    assert np.array_equal(rows[6], rows[0])


def test_an_upload_whose_retry_is_refused_after_a_timeout_stays_in_doubt(s3_stub: S3Stub, make: Any) -> None:
    """Review (2026-12-05): only the last attempt's error decided whether an upload was in doubt,
    so a PUT that timed out (and landed) and whose retry was then refused (SlowDown here; a
    refused connection, denied credentials) was taken as never stored and never announced."""
    tier, _ = make(s3_stub.endpoint, s3_stub.bucket, request_timeout=0.5, job_timeout=3.0, max_retries=0,
                   failure_threshold=1000)  # fmt: skip
    wait_ready(tier)
    (key,) = chain_ids(range(1), tier.context.namespace)
    s3_stub.fault(tier.object_path(key), "stall_after_write")
    puts = s3_stub.count("PUT")
    tier.take_events()
    job = new_job([key], [0], False)
    tier.submit_store(job)
    deadline = time.monotonic() + 5
    while s3_stub.count("PUT") == puts:  # the first attempt is in: its retry is answered SlowDown
        assert time.monotonic() < deadline, "the upload never went out"
        time.sleep(0.005)
    with s3_stub.lock:
        s3_stub.slowdowns = 1
    result = wait_results(tier, {job.job_id}, 10)[job.job_id]
    assert not result.success and tier.stats.extra["requests_retried"] == 1, result
    s3_stub.release()
    deadline = time.monotonic() + 10
    while not tier.holds(key):
        assert time.monotonic() < deadline, "the upload in doubt was not checked"
        time.sleep(0.02)
    assert [e.keys for e in tier.take_events() if not e.removed] == [(key,)]
    assert tier.stats.extra["uploads_found"] == 1


def test_a_hanging_server_fails_jobs_by_their_deadline_without_blocking_the_scheduler(
    s3_stub: S3Stub, make: Any
) -> None:
    tier, rows = make(s3_stub.endpoint, s3_stub.bucket, **FAST)
    keys = chain_ids(range(6), tier.context.namespace)
    assert run_job(tier, keys[:2], [0, 1], False, 10).success
    s3_stub.hang()
    worst = 0.0
    load = new_job(keys[:2], [10, 11], True)
    t0 = time.perf_counter()
    store = new_job(keys[2:4], [2, 3], False)
    tier.submit_load(load)
    tier.submit_store(store)
    worst = time.perf_counter() - t0
    hung_at = time.monotonic()
    got: dict[int, JobResult] = {}
    miss_at = None
    while time.monotonic() - hung_at < 6 and (load.job_id not in got or miss_at is None):
        t0 = time.perf_counter()
        answer = tier.lookup(keys[5], None)
        tier.on_schedule_end()
        got.update({r.job_id: r for r in tier.poll_finished()})
        tier.has_pending_work()
        tier.health()
        worst = max(worst, time.perf_counter() - t0)
        if answer is LookupResult.MISS and miss_at is None:
            miss_at = time.monotonic() - hung_at
        time.sleep(0.01)
    assert worst < SCHEDULER_CALL_LIMIT, f"a scheduler call took {worst * 1000:.1f} ms"
    assert miss_at is not None and miss_at < 3.0, f"lookups answered MISS only after {miss_at}s"
    result = got[load.job_id]
    assert not result.success and "timed out" in (result.error or "")
    assert tier.health().state is not HealthState.CLOSED
    # A request started before the deadline may end up to request_timeout after it: the server
    # comes back only once the store job can no longer be in flight (it must have failed).
    time.sleep(max(0.0, hung_at + FAST["job_timeout"] + FAST["request_timeout"] + 0.2 - time.monotonic()))
    s3_stub.release()
    got.update(wait_results(tier, {store.job_id} - set(got), 10))
    assert not got[store.job_id].success
    deadline = time.monotonic() + 10
    while tier.health().state is not HealthState.CLOSED:
        assert time.monotonic() < deadline, f"no recovery: {tier.health()}"
        time.sleep(0.02)
    back = run_job(tier, keys[:2], [12, 13], True, 10)
    assert back.success, back.error
    assert np.array_equal(rows[12:14], rows[0:2])


def test_a_failed_probe_says_why_in_one_line(s3_bucket: tuple[MotoServer, str], make: Any) -> None:
    """Regression (review r8, 2026-12-03): once a probe had failed, ``health().detail`` was the
    raw client error (the URL, the retry dump, the server's XML body) instead of the one line
    the tier gave when it went out of service."""
    import urllib.request

    import obstore as obs

    server, bucket = s3_bucket
    tier, _ = make(server.endpoint, bucket, **FAST)
    keys = chain_ids(range(4), tier.context.namespace)
    assert run_job(tier, keys[:2], [0, 1], False, 10).success
    client = raw_client(server.endpoint, bucket)  # the operator empties and deletes the bucket
    for batch in obs.list(client):
        for meta in batch:
            obs.delete(client, meta["path"])
    urllib.request.urlopen(urllib.request.Request(f"{server.endpoint}/{bucket}", method="DELETE"), timeout=10).read()
    assert not run_job(tier, keys[2:], [2, 3], False, 10).success
    gone = "the bucket does not exist"
    assert tier.health().detail.startswith(gone)
    deadline = time.monotonic() + 10
    while not tier.health().detail.startswith("health probe failed"):
        assert time.monotonic() < deadline, f"no probe ran: {tier.health()}"
        tier.lookup(keys[0], None)
        tier.on_schedule_end()
        time.sleep(0.05)
    detail = tier.health().detail
    assert gone in detail and "\n" not in detail and "<?xml" not in detail and "<Error>" not in detail, detail


def test_a_store_without_conditional_writes_gets_its_manifest(s3_stub: S3Stub, make: Any) -> None:
    """Regression (review r8, 2026-12-03): the manifest was always uploaded with ``If-None-Match:
    *``; a server without conditional writes answers 501 NotImplemented, so a fresh namespace never
    got its manifest and the tier stayed out of service (its detail the raw 501 dump)."""
    s3_stub.conditional_writes = False
    tier, rows = make(s3_stub.endpoint, s3_stub.bucket, **FAST)
    keys = chain_ids(range(2), tier.context.namespace)
    result = run_job(tier, keys, [0, 1], False, 10)
    assert result.success, (result.error, tier.health())
    assert tier.health().state is HealthState.CLOSED
    (name,) = [n for n in s3_stub.objects if n.endswith("/manifest.json")]
    manifest = json.loads(s3_stub.objects[name])
    assert manifest["block_bytes"] == BLOCK
    assert run_job(tier, keys, [4, 5], True, 10).success and np.array_equal(rows[4:6], rows[0:2])


def test_without_conditional_writes_a_manifest_another_engine_put_last_is_checked(
    s3_stub: S3Stub, make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review r10 (2026-12-03): the plain upload of the fallback above was taken as the manifest;
    an engine of the same namespace digest but another block size uploading right after it
    (nothing conditional stops it) left both engines in service. The upload is read back."""
    import obstore

    s3_stub.conditional_writes = False
    plain_put = obstore.put

    def racing_put(store: Any, path: str, body: Any, **kwargs: Any) -> Any:
        result = plain_put(store, path, body, **kwargs)
        if path.endswith("/manifest.json") and kwargs.get("mode") is None:  # the other engine's, just after
            theirs = dict(json.loads(bytes(body)), block_bytes=2 * BLOCK)
            plain_put(store, path, json.dumps(theirs).encode(), **kwargs)
        return result

    monkeypatch.setattr(obstore, "put", racing_put)
    tier, _ = make(s3_stub.endpoint, s3_stub.bucket, **FAST)
    result = run_job(tier, chain_ids(range(1), tier.context.namespace), [0], False, 10)
    assert not result.success
    assert tier.health().state is not HealthState.CLOSED
    assert f"holds block_bytes={2 * BLOCK}, this engine needs {BLOCK}" in tier.health().detail


def test_shutdown_waits_out_an_existence_check_longer_than_a_job(s3_stub: S3Stub, make: Any) -> None:
    """Regression (review r8, 2026-12-03): shutdown joined the I/O threads for the job deadline
    plus one request (4 s here) though a HEAD thread may be inside one existence check of up to
    ``check_timeout`` (5 s here): with the server hung, ``shutdown()`` raised TierError and kept
    the CPU rows (under a manager: TierShutdownError, the region left mapped)."""
    options = {"request_timeout": 0.5, "connect_timeout": 0.3, "job_timeout": 1.5, "check_timeout": 5.0}
    tier, _ = make(s3_stub.endpoint, s3_stub.bucket, **options)
    wait_ready(tier)
    keys = chain_ids(range(4), tier.context.namespace)
    s3_stub.hang()
    try:
        assert all(tier.lookup(k, None) is LookupResult.RETRY for k in keys)
        tier.on_schedule_end()  # their existence checks start, and hang
        time.sleep(0.3)
        t0 = time.monotonic()
        tier.shutdown()
        took = time.monotonic() - t0
    finally:
        s3_stub.release()
    assert took < 5.0 + 2.0, f"shutdown took {took:.1f}s"


@pytest.mark.parametrize(("fault", "corrupt"), [("truncate", False), ("wrong_length", True), ("wrong_header", True)])
def test_bad_bodies_fail_only_their_key(s3_stub: S3Stub, make: Any, fault: str, corrupt: bool) -> None:
    tier, rows = make(s3_stub.endpoint, s3_stub.bucket, max_retries=0)
    keys = chain_ids(range(2), tier.context.namespace)
    assert run_job(tier, keys, [0, 1], False, 10).success
    tier.take_events()
    rows[4:6] = 0
    s3_stub.fault(tier.object_path(keys[0]), fault)
    result = run_job(tier, keys, [4, 5], True, 10)
    assert result.succeeded(keys) == [keys[1]]
    assert np.array_equal(rows[5], rows[1])
    stored = s3_stub.object_key(tier.object_path(keys[0])) in s3_stub.objects
    if corrupt:
        assert tier.stats.corrupt_values == 1 and not stored, "a corrupt object is counted and deleted"
        assert any(e.removed and e.keys == (keys[0],) for e in tier.take_events())
        assert resolve(tier, keys[0], 5) is LookupResult.MISS
    else:
        assert tier.stats.corrupt_values == 0 and stored, "a transport error is no proof of corruption"
        again = run_job(tier, [keys[0]], [6], True, 10)
        assert again.success and np.array_equal(rows[6], rows[0])


@pytest.mark.parametrize("resized", [False, True])
def test_an_object_of_another_releases_format_is_a_miss_and_kept(s3_stub: S3Stub, make: Any, resized: bool) -> None:
    """Regression (review, 2026-12-02): an object in a newer release's format version was deleted as corrupt."""
    tier, rows = make(s3_stub.endpoint, s3_stub.bucket, max_retries=0)
    keys = chain_ids(range(2), tier.context.namespace)
    assert run_job(tier, keys, [0, 1], False, 10).success
    tier.take_events()
    name = s3_stub.object_key(tier.object_path(keys[0]))
    value = bytearray(s3_stub.objects[name])
    value[8:12] = (3).to_bytes(4, "little")
    newer = bytes(value) + (b"\x00" * 100 if resized else b"")
    s3_stub.objects[name] = newer
    rows[4:6] = 0
    result = run_job(tier, keys, [4, 5], True, 10)
    assert result.succeeded(keys) == [keys[1]]
    assert np.array_equal(rows[5], rows[1])
    assert s3_stub.objects.get(name) == newer, "another release's object must be left in place"
    assert tier.stats.corrupt_values == 0 and tier.stats.extra.get("foreign_format") == 1
    assert not any(e.removed and keys[0] in e.keys for e in tier.take_events())
    assert resolve(tier, keys[0], 5) is LookupResult.MISS


@pytest.mark.parametrize("planted", ["empty", "short", "long", "value-sized", "another key's block", "newer format"])
def test_create_only_never_overwrites_and_never_claims_what_it_cannot_serve(
    s3_stub: S3Stub, make: Any, planted: str
) -> None:
    """Regression (2026-12-04): a create_only store refused by a stranger's object under the block's
    name (or another release's value) was counted as stored and reported to the fleet, though no
    load could serve it; one of a block's size was then deleted as corrupt by the next load."""
    tier, _ = make(s3_stub.endpoint, s3_stub.bucket, create_only=True, miss_seconds=0.5)
    key, other = chain_ids(range(2), tier.context.namespace)
    assert run_job(tier, [other], [1], False, 10).success
    tier.take_events()
    value = s3_stub.objects[s3_stub.object_key(tier.object_path(other))]
    newer = bytearray(value)
    newer[8:12] = (FORMAT_VERSION + 1).to_bytes(4, "little")
    body = {"empty": b"", "short": b"someone else's", "long": b"x" * (VALUE + 1), "value-sized": b"s" * VALUE,
            "another key's block": value, "newer format": bytes(newer)}[planted]  # fmt: skip
    name = s3_stub.object_key(tier.object_path(key))
    s3_stub.objects[name] = body
    result = run_job(tier, [key], [0], False, 10)
    assert not result.success and "left in place" in (result.error or ""), result.error
    assert s3_stub.objects[name] == body, "create_only must never overwrite"
    assert tier.stats.extra["create_conflicts"] == 1 and tier.stats.extra["objects_written"] == 1
    assert not any(key in e.keys for e in tier.take_events()), "no stored event for a block not stored"
    assert resolve(tier, key, 5) is LookupResult.MISS
    time.sleep(0.6)  # past miss_seconds: asked again (a value-sized one passes the existence check)
    if resolve(tier, key, 5) is LookupResult.HIT:
        assert not run_job(tier, [key], [2], True, 10).success
    assert s3_stub.objects.get(name) == body, "create_only never deletes an object (review, 2026-12-04)"
    assert tier.health().state is HealthState.CLOSED, "a refused upload is no failure of the store"


@pytest.mark.parametrize("ranges", [True, False], ids=["ranged", "store-ignores-ranges"])
def test_create_only_takes_the_same_block_stored_by_another_engine(
    s3_stub: S3Stub, make: Any, ranges: bool
) -> None:
    """Two engines of one namespace store one block: the second PUT is refused, the block counts as
    stored (its header and size checked), nothing is overwritten, and it loads the first's bytes.
    The check GETs the header's bytes only (it GOT the whole object before 2026-12-04); a store
    that ignores the range gets a plain GET."""
    s3_stub.ranges = ranges
    ns = make_namespace(BLOCK)
    first, first_rows = make(s3_stub.endpoint, s3_stub.bucket, ns, seed=1, create_only=True)
    second, second_rows = make(s3_stub.endpoint, s3_stub.bucket, ns, seed=2, create_only=True)
    (key,) = chain_ids(range(1), ns)
    assert run_job(first, [key], [0], False, 10).success
    name = s3_stub.object_key(first.object_path(key))
    stored = s3_stub.objects[name]
    wait_ready(second)
    second.take_events()
    assert run_job(second, [key], [0], False, 10).success
    assert s3_stub.objects[name] == stored
    assert second.stats.extra["objects_written"] == 0 and second.stats.extra.get("create_conflicts", 0) == 0
    assert s3_stub.ranged_gets == [f"bytes=0-{HEADER_SIZE - 1}"], "the check asks for the header only"
    assert any(key in e.keys and not e.removed for e in second.take_events())
    assert second.lookup(key, None) is LookupResult.HIT
    assert run_job(second, [key], [5], True, 10).success
    assert np.array_equal(second_rows[5], first_rows[0])


def test_create_only_on_moto_takes_the_block_another_engine_stored(
    s3_bucket: tuple[MotoServer, str], make: Any
) -> None:
    """The same on a real S3 implementation (moto): its 412 to the second PUT, its 206 to the
    header check; and a stranger's empty object (moto's 416 to the range) is refused, untouched."""
    import obstore as obs

    server, bucket = s3_bucket
    ns = make_namespace(BLOCK)
    first, first_rows = make(server.endpoint, bucket, ns, seed=1, create_only=True)
    second, second_rows = make(server.endpoint, bucket, ns, seed=2, create_only=True)
    key, planted = chain_ids(range(2), ns)
    assert run_job(first, [key], [0], False, 10).success
    wait_ready(second)
    assert run_job(second, [key], [0], False, 10).success
    assert second.stats.extra["objects_written"] == 0 and second.stats.extra.get("create_conflicts", 0) == 0
    assert run_job(second, [key], [5], True, 10).success
    assert np.array_equal(second_rows[5], first_rows[0])
    raw = raw_client(server.endpoint, bucket)
    obs.put(raw, second.object_path(planted), b"")
    result = run_job(second, [planted], [1], False, 10)
    assert not result.success and "an object of 0 bytes" in (result.error or ""), result.error
    assert second.stats.extra["create_conflicts"] == 1
    assert bytes(obs.get(raw, second.object_path(planted)).bytes()) == b""


def test_warm_start_answers_hit_without_existence_checks(s3_bucket: tuple[MotoServer, str], make: Any) -> None:
    import obstore as obs

    server, bucket = s3_bucket
    ns = make_namespace(BLOCK)
    writer, _ = make(server.endpoint, bucket, ns)
    keys = chain_ids(range(3), ns)
    assert run_job(writer, keys, [0, 1, 2], False, 20).success
    raw = raw_client(server.endpoint, bucket)
    obs.put(raw, f"kvtier/{ns.hexdigest}/zz/not-a-block", b"x")
    obs.put(raw, writer.object_path(chain_ids([99], ns)[0]), b"short")  # a block object of the wrong size
    reader, _ = make(server.endpoint, bucket, ns, warm_start=True)
    deadline = time.monotonic() + 10
    while reader.stats.extra.get("warm_start_blocks") is None:
        assert time.monotonic() < deadline, "warm start did not finish"
        time.sleep(0.01)
    assert reader.stats.extra["warm_start_blocks"] == 3
    assert [reader.lookup(k, None) for k in keys] == [LookupResult.HIT] * 3
    assert reader.stats.extra["checks"] == 0


def test_the_tier_lists_what_it_knows_the_bucket_holds_for_the_fleet(
    s3_bucket: tuple[MotoServer, str], make: Any
) -> None:
    """Added 2026-12-04: an S3 tier listed no holdings, so a fleet index that lost an engine's
    events (ZMQ dropped more than the replay buffer held) never got that engine's S3 blocks back
    (an fs root's snapshot brings them). ``held_keys`` now lists what the existence index answers
    HIT for (stored, loaded, checked; a warm start's listing once done), never the whole bucket."""
    import obstore as obs

    server, bucket = s3_bucket
    ns = make_namespace(BLOCK)
    writer, _ = make(server.endpoint, bucket, ns)
    keys = chain_ids(range(4), ns)
    assert writer.lists_holdings and writer.held_keys() == [] and not writer.holdings_complete()
    assert run_job(writer, keys[:3], [0, 1, 2], False, 20).success
    assert sorted(writer.held_keys() or []) == sorted(keys[:3])
    assert writer.holds(keys[0]) and not writer.holds(keys[3])
    obs.put(raw_client(server.endpoint, bucket), writer.object_path(keys[3]), b"short")  # not a block: not listed
    reader, _ = make(server.endpoint, bucket, ns, warm_start=True)
    deadline = time.monotonic() + 10
    while (held := reader.held_keys()) is None:  # None while the listing is under way
        assert time.monotonic() < deadline, "warm start did not finish"
        time.sleep(0.01)
    assert sorted(held) == sorted(keys[:3])


def test_warm_start_lists_around_foreign_names_the_client_cannot_parse(
    s3_bucket: tuple[MotoServer, str], make: Any
) -> None:
    """Review U4: one foreign object named 'x//y' or 'x/./y' under the namespace ended the whole
    listing ('warm-start listing stopped', 0 blocks found)."""
    server, bucket = s3_bucket
    ns = make_namespace(BLOCK)
    writer, _ = make(server.endpoint, bucket, ns)
    keys = chain_ids(range(3), ns)
    assert run_job(writer, keys, [0, 1, 2], False, 20).success
    for name in ("x//y", "x/./y", "//top"):
        put_plain(server.endpoint, bucket, f"kvtier/{ns.hexdigest}/{name}")
    reader, _ = make(server.endpoint, bucket, ns, warm_start=True)
    deadline = time.monotonic() + 20
    while reader.stats.extra.get("warm_start_blocks") is None:
        assert time.monotonic() < deadline, "warm start did not finish"
        time.sleep(0.01)
    assert reader.stats.extra["warm_start_blocks"] == 3
    assert [reader.lookup(k, None) for k in keys] == [LookupResult.HIT] * 3


def test_https_endpoint_behind_a_private_ca(tmp_path: Path, make: Any) -> None:
    from tls_certificates import make_test_certificates

    ca, cert, key = make_test_certificates(tmp_path / "certs")
    stub = S3Stub(tls=(cert, key))
    try:
        trusted, rows = make(stub.endpoint, stub.bucket, ca_file=str(ca))
        keys = chain_ids(range(2), trusted.context.namespace)
        assert run_job(trusted, keys, [0, 1], False, 10).success
        assert run_job(trusted, keys, [4, 5], True, 10).success
        assert np.array_equal(rows[4:6], rows[0:2])
        stranger, _ = make(stub.endpoint, stub.bucket, **FAST)
        result = run_job(stranger, keys, [0, 1], False, 10)
        assert not result.success, "a server whose CA is not trusted must not be written to"
    finally:
        stub.close()


def test_credentials_from_the_standard_chain_or_explicit(
    s3_stub: S3Stub, make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDFROMTHEENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    options = {k: v for k, v in s3_options(s3_stub.endpoint, s3_stub.bucket).items() if k != "type"}
    del options["access_key_id"], options["secret_access_key"]
    rows = np.zeros((2, BLOCK), dtype=np.uint8)
    tier = S3Tier(TierContext(rows, BLOCK, make_namespace(BLOCK)), **options)
    try:
        assert run_job(tier, chain_ids(range(1), tier.context.namespace), [0], False, 10).success
    finally:
        tier.shutdown()
    assert s3_stub.access_keys == {"AKIDFROMTHEENV"}
    explicit, _ = make(s3_stub.endpoint, s3_stub.bucket, access_key_id="AKIDEXPLICIT")
    assert run_job(explicit, chain_ids(range(1), explicit.context.namespace), [0], False, 10).success
    assert "AKIDEXPLICIT" in s3_stub.access_keys


# --- options ------------------------------------------------------------------------------------------


def _ctx() -> TierContext:
    return TierContext(np.zeros((2, BLOCK), dtype=np.uint8), BLOCK, make_namespace(BLOCK))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"endpoint": "http://127.0.0.1:9000"}, "allow_http"),
        ({"request_timeout": 5, "job_timeout": 5}, "job_timeout"),
        ({"bucket": "No_Such"}, "bucket"),
        ({"prefix": "a/../b"}, "prefix"),
        ({"prefix": "p" * 860}, "prefix is 860 characters; at most 859"),  # review r8: names over 1,024 bytes
        ({"endpoint": "https://host:9000/bucket"}, "must not have a path"),
        ({"endpoint": "ftp://host"}, "endpoint"),
        ({"access_key_id": "x"}, "both access_key_id"),
        ({"ca_file": "/nonexistent/ca.pem"}, "ca_file"),
        ({"max_in_flight": 0}, "max_in_flight"),
        ({"endpoint": "https://127.0.0.1:9000", "path_style": False}, "virtual-hosted"),
        ({"bukket": "x"}, "'bukket': is not a setting"),
        ({"endpoint": "http://127.0.0.1:9000#", "allow_http": True}, "'#' fragment"),  # review U1
        ({"endpoint": "http://127.0.0.1:9000/#", "allow_http": True}, "'#' fragment"),
    ],
)
def test_bad_options_name_the_problem(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        S3Tier(_ctx(), **{"bucket": "kv-cache", **options})


def test_the_longest_prefix_allowed_names_objects_within_s3s_limit() -> None:
    """Regression (review r8, 2026-12-03): a prefix of any length was accepted, and one over ~860
    characters named every object past S3's 1,024-byte limit (the tier never came into service;
    its detail never named the prefix)."""
    prefix = S3TierOptions(bucket="kv-cache", prefix="p" * 859).prefix
    ns_prefix = f"{prefix}/{make_namespace(BLOCK).hexdigest}"
    longest = object_path(ns_prefix, bytes(range(MAX_KEY_BYTES)))
    assert len(longest.encode()) == 1024


def test_addressing_follows_the_endpoint() -> None:
    def style(**o: Any) -> bool:
        return S3TierOptions(bucket="kv-cache", allow_http=True, **o).uses_path_style

    assert style(endpoint="http://127.0.0.1:9000") is True
    assert style(endpoint="http://localhost:9000") is True
    assert style(endpoint="https://minio.internal") is True
    assert style() is False  # AWS: virtual-hosted
    assert style(endpoint="https://s3.eu-west-1.amazonaws.com") is False
    assert style(endpoint="https://minio.internal", path_style=False) is False


def test_config_file_validates_and_redacts_secrets(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(
        "model: tiny\ntiers:\n  - type: s3\n    bucket: kv-cache\n    endpoint: https://minio.internal:9000\n"
        "    access_key_id: AKIDEXAMPLE\n    secret_access_key: hunter2-secret\n"
    )
    config = load_config(path, env={})
    shown = json.dumps(describe_config(config))
    assert "hunter2-secret" not in shown and "AKIDEXAMPLE" not in shown
    path.write_text("model: tiny\ntiers:\n  - type: s3\n    bucket: kv-cache\n    max_in_flite: 3\n")
    with pytest.raises(ConfigError, match="max_in_flite"):
        load_config(path, env={})


def test_registry_builds_it_and_describe_hides_credentials(s3_stub: S3Stub) -> None:
    tier = create_tier(s3_options(s3_stub.endpoint, s3_stub.bucket, secret_access_key="hunter2"), _ctx())
    try:
        assert isinstance(tier, S3Tier)
        info = tier.describe()
        assert "hunter2" not in json.dumps(info) and info["path_style"] is True
        assert info["namespace_prefix"].startswith("kvtier/")
    finally:
        tier.shutdown()


def test_store_runs_before_the_first_housekeeping(s3_stub: S3Stub) -> None:
    """Regression: stores submitted right after construction were dropped until the manifest was checked."""
    rows = np.random.default_rng(1).integers(0, 256, (4, BLOCK), dtype=np.uint8)
    ns = Namespace("first-store", KVGeometry.from_block_bytes(BLOCK))
    options = {k: v for k, v in s3_options(s3_stub.endpoint, "stub").items() if k != "type"}
    tier = S3Tier(TierContext(rows, BLOCK, ns), **options)
    try:
        keys = chain_ids(range(2), ns)
        assert run_job(tier, keys, [0, 1], False, 10).success
    finally:
        tier.shutdown()


@pytest.mark.parametrize("secret", ["73918264055", "[7391, 8264]", "true"])
def test_a_secret_of_the_wrong_type_is_never_echoed(tmp_path: Path, secret: str) -> None:
    """Review S1: an all-digit secret (YAML reads it as a number), a list or a bool is refused
    without showing it, from a config file and from tier options."""
    path = tmp_path / "kvtier.yaml"
    path.write_text(
        "model: tiny\ntiers:\n  - type: s3\n    bucket: kv-cache\n    endpoint: https://minio.internal:9000\n"
        f"    access_key_id: minio\n    secret_access_key: {secret}\n"
    )
    with pytest.raises(ConfigError, match="secret_access_key") as raised:
        load_config(path, env={})
    assert "7391" not in str(raised.value) and "True" not in str(raised.value), raised.value
    with pytest.raises(ConfigError, match="session_token") as raised:
        S3Tier(_ctx(), bucket="kv-cache", session_token=73918264055)
    assert "7391" not in str(raised.value), raised.value
    with pytest.raises(ConfigError, match="got 'many'"):  # other values are still shown
        S3Tier(_ctx(), bucket="kv-cache", max_in_flight="many")


@pytest.mark.parametrize(
    ("model", "spec"),
    [
        ("s3", {"bucket": "bkt", "endpoint": ["http://AKIA:QQs1hunter2@h:9000"]}),
        ("redis", {"url": ["redis://:QQs1hunter2@cache:6379"]}),
        ("redis", {"url": {"redis://:QQs1hunter2@cache:6379": None}}),
        # review s3c #2: a long URL whose '@' the shortened display cut away showed user and password
        ("redis", {"url": ["rediss://kvtier-user:QQs1hunter2@cache-primary.prod.eu-west-1.internal.example.com:6380"]}),
        ("redis", {"url": ["redis://default:QQs1hunter2-long-password-0123456789abcdef@cache.internal:6379/0"]}),
        ("s3", {"bucket": "bkt", "endpoint": {
            "http://AKIAIOSFODNN7EXAMPLE:QQs1hunter2wJalr@" "minio.internal.example.com:9000": 1}}),
        ("s3", {"bucket": "bkt", "endpoint": [1, 2, 3, 4, 5, "http://AKIA:QQs1hunter2@h:9000"]}),  # past what is shown
        ("redis", {"url": [[[["x" * 100, {"k": ("redis://:QQs1hunter2@cache:6379",)}]]]]}),
        # review 3 #3: a secret in the URL's query, no '@' anywhere
        ("redis", {"url": ["rediss://cache:6379/0?password=QQs1hunter2"]}),
        ("redis", {"url": ("redis://cache/?ssl_keyfile_password=QQs1hunter2",)}),
    ],
)
def test_a_url_option_of_the_wrong_type_is_never_echoed(model: str, spec: dict[str, Any]) -> None:
    """Review s3b #6: a list or mapping given for a URL-valued option (endpoint, redis url) was
    shown as it came, userinfo included."""
    from kvtier.tiers.options import validate_options
    from kvtier.tiers.redis import RedisTierOptions

    with pytest.raises(ConfigError) as raised:
        validate_options(S3TierOptions if model == "s3" else RedisTierOptions, model, spec)
    text = str(raised.value)
    assert "QQs1" not in text and "hunter2" not in text and "not shown" in text, text
    assert "AKIA" not in text and "kvtier-user" not in text and "default:" not in text, text


def test_a_wrong_typed_value_is_walked_whole_within_bounds_and_shown_when_it_holds_no_at() -> None:
    """Review s3c #2: whether to hide is decided from the whole value (not its shortened display),
    walking at most a bounded number of items and levels; a value past the bounds is not shown,
    one within them that holds no '@' still is."""
    import time

    from kvtier.tiers.options import validate_options
    from kvtier.tiers.redis import RedisTierOptions

    with pytest.raises(ConfigError, match=r"got \['redis-host', 6379\]"):
        validate_options(RedisTierOptions, "redis", {"url": ["redis-host", 6379]})
    bomb: list[Any] = ["a"]
    for _ in range(40):  # a YAML alias bomb: 2**40 leaves, built in 40 steps
        bomb = [bomb, bomb]
    started = time.monotonic()
    for value in (bomb, ["x"] * 100_000, [[[[[[[[[["x"]]]]]]]]]]):
        with pytest.raises(ConfigError, match="not shown: it is too large or too deep to check") as raised:
            validate_options(RedisTierOptions, "redis", {"url": value})
        assert len(str(raised.value)) < 300, raised.value
    assert time.monotonic() - started < 5


def test_an_upper_case_s3_scheme_with_credentials_is_refused() -> None:
    """Review s3b #7: 'S3://key:secret@bucket/p' was accepted and its keys silently dropped."""
    from kvtier.tiers.s3_inspect import options_from_url

    with pytest.raises(ConfigError, match="carries credentials") as raised:
        options_from_url("S3://AKIA:QQs1hunter2@bucket/p")
    assert "QQs1" not in str(raised.value)


def test_errors_are_classified_by_status_and_code_never_by_names_in_the_url(
    s3_stub: S3Stub, make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review U2: a bucket named 'kv-credentials' turned one 5xx into "no S3 credentials" and
    tripped the breaker; a prefix holding 'NoSuchBucket' would do the same for every 404."""
    import obstore as obs

    prefix = "NoSuchBucket-TimedOut/credential/latest/meta-data"
    raw = raw_client(s3_stub.endpoint, "kv-credentials", max_retries=0)
    with pytest.raises(FileNotFoundError) as missing:
        obs.get(raw, f"{prefix}/x")
    s3_stub.slowdowns = 1
    with pytest.raises(Exception) as throttled:
        obs.get(raw, f"{prefix}/x")
    assert (classify_error(missing.value), classify_error(throttled.value)) == ("missing", "throttled")

    tier, _ = make(s3_stub.endpoint, "kv-credentials", prefix=prefix, **{**FAST, "max_retries": 0})
    keys = chain_ids(range(1), tier.context.namespace)
    assert run_job(tier, keys, [0], False, 10).success
    s3_stub.slowdowns = 1
    assert not run_job(tier, keys, [0], True, 10).success
    health = tier.health()
    assert health.state is HealthState.CLOSED and "credentials" not in health.detail, health

    monkeypatch.setenv("AWS_METADATA_ENDPOINT", s3_stub.endpoint)  # the real thing still reads as such
    chain = open_store_without_keys(s3_stub.endpoint)
    s3_stub.slowdowns = 1
    with pytest.raises(Exception) as imds:
        obs.get(chain, "kvtier/x")
    assert classify_error(imds.value) == "credentials"


def open_store_without_keys(endpoint: str) -> Any:
    from kvtier.tiers.s3_store import open_store

    return open_store(S3TierOptions(bucket="stub", endpoint=endpoint, allow_http=True, max_retries=0))


def test_store_location_names_the_endpoint_in_use(s3_stub: S3Stub, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review M2: an endpoint from AWS_ENDPOINT_URL was spelled 'aws', so two stores shared one
    fleet id and one store had two; and describe() re-read the environment after construction."""
    options = {k: v for k, v in s3_options(s3_stub.endpoint, s3_stub.bucket).items() if k != "type"}
    named = create_tier({"type": "s3", **options}, _ctx())
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_stub.endpoint)
    del options["endpoint"]
    from_env = create_tier({"type": "s3", **options}, _ctx())
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        assert named.store_location() == from_env.store_location() == f"s3:{s3_stub.endpoint}/stub/kvtier"
        assert from_env.describe()["endpoint"] == s3_stub.endpoint
    finally:
        named.shutdown()
        from_env.shutdown()
