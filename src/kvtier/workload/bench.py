"""``kvtier bench``: a multi-turn chat workload through the whole stack, with real bytes.

The bench plays an inference engine around a real
:class:`~kvtier.manager.TieringManager`:

* a simulated device KV pool (a numpy array of ``device_blocks`` blocks, smaller
  than the working set) with its own LRU prefix cache, as an engine's GPU has;
* "prefill" of a block writes bytes derived from its key
  (:class:`BlockContent`) into a device slot;
* device <-> CPU copies run on a :class:`~kvtier.transfer.TransferEngine`;
* the manager cascades stored blocks to the secondary tiers (an fs tier in a
  temporary directory by default) and promotes them back on a hit;
* every block loaded into the device is compared byte for byte with what its
  key must hold; any difference is counted as an error.

The scheduler side (every manager call) is timed separately from the copies.
Called from one thread (the caller's), which plays the engine's scheduler;
the transfer engine's and the tiers' threads are started and joined here.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.config import KvtierConfig, build_manager, format_size, parse_size
from kvtier.errors import ConfigError, KvtierError
from kvtier.keys import BlockKey, Namespace, prefix_keys
from kvtier.manager import TieringManager
from kvtier.metrics import KvtierMetrics
from kvtier.transfer import TransferEngine, TransferResult, aligned_host_array
from kvtier.types import LookupResult, RequestContext
from kvtier.workload.chat import ChatRequest, ChatWorkloadSpec, generate_chat

logger = logging.getLogger(__name__)

DEFAULT_BENCH_CPU_BYTES = 256 * 1024**2
DEFAULT_BENCH_FS_BYTES = 1024**3
DEFAULT_BENCH_MODEL = "qwen2.5-0.5b"


@dataclass
class BenchOptions:
    """What ``kvtier bench`` runs. ``fs_root=None`` uses a temporary directory (removed after)."""

    workload: ChatWorkloadSpec = field(default_factory=ChatWorkloadSpec)
    model: str = DEFAULT_BENCH_MODEL
    tokens_per_block: int = 16
    cpu_bytes: int = DEFAULT_BENCH_CPU_BYTES
    device_blocks: int = 512
    policy: str = "lru"
    fs: bool = True
    fs_root: str | None = None
    fs_bytes: int | None = DEFAULT_BENCH_FS_BYTES
    redis_url: str | None = None
    extra_tiers: list[dict[str, Any]] = field(default_factory=list)
    batch_size: int = 4
    shm_dir: str = "/dev/shm"
    stall_timeout_s: float = 60.0
    prefill_tokens_per_s: float = 25_000.0
    """Simulated device compute: each step sleeps (tokens computed) / this rate; 0 = no compute time."""
    base_config: KvtierConfig | None = None
    """A resolved configuration to bench instead of the fields above (CPU size, policy, model,
    geometry, shm_dir, tiers); ``fs``/``redis_url``/``extra_tiers`` add tiers behind its own."""

    def config(self, fs_root: str | None) -> KvtierConfig:
        """The :class:`KvtierConfig` of this run (``fs_root``: the resolved fs directory)."""
        tiers: list[dict[str, Any]] = []
        if self.fs and fs_root is not None:
            spec: dict[str, Any] = {"type": "fs", "root": fs_root}
            if self.fs_bytes is not None:
                spec["max_bytes"] = self.fs_bytes
            tiers.append(spec)
        if self.redis_url:
            tiers.append({"type": "redis", "url": self.redis_url})
        tiers.extend(self.extra_tiers)
        if self.base_config is not None:
            return self.base_config.model_copy(update={"tiers": [*self.base_config.tiers, *tiers]})
        return KvtierConfig.model_validate(
            {
                "cpu_bytes": self.cpu_bytes,
                "policy": self.policy,
                "model": self.model,
                "geometry": {"tokens_per_block": self.tokens_per_block},
                "shm_dir": self.shm_dir,
                "tiers": tiers,
            }
        )


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


@dataclass
class RequestRecord:
    """Per-request outcome, in scheduling order (for the timeline)."""

    req_id: str
    blocks: int
    device_hits: int
    tier_hits: dict[str, int]
    computed: int
    scheduled_s: float


@dataclass
class BenchResult:
    """Everything ``kvtier bench`` reports; :meth:`to_dict` is the ``--json`` document."""

    options: dict[str, Any]
    geometry: dict[str, Any]
    tiers: list[str]
    requests: int = 0
    block_refs: int = 0
    prompt_tokens: int = 0
    hits: dict[str, int] = field(default_factory=dict)
    computed_blocks: int = 0
    blocks_verified: int = 0
    verify_failures: int = 0
    transfer_failures: int = 0
    store_rejections: int = 0
    promotion_failures: int = 0
    tier_failures: int = 0
    stores_shed: int = 0
    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    job_seconds: dict[str, float] = field(default_factory=dict)
    lookup_ns: list[int] = field(default_factory=list)
    step_ns: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    setup_s: float = 0.0
    timeline: list[RequestRecord] = field(default_factory=list)
    manager_stats: dict[str, Any] = field(default_factory=dict)
    tokens_per_block: int = 16

    @property
    def errors(self) -> int:
        return self.verify_failures + self.transfer_failures + self.promotion_failures + self.tier_failures

    def hit_rate(self, tier: str) -> float:
        return self.hits.get(tier, 0) / self.block_refs if self.block_refs else 0.0

    @property
    def tokens_saved(self) -> int:
        return sum(self.hits.values()) * self.tokens_per_block

    def gbps(self, direction: str) -> float | None:
        seconds = self.seconds.get(direction, 0.0)
        moved = self.bytes.get(direction, 0)
        return moved / seconds / 1e9 if seconds > 0 and moved else None

    @staticmethod
    def _pct(values: list[int], q: float) -> float:
        return float(np.percentile(np.asarray(values, dtype=np.float64), q)) / 1000 if values else 0.0

    def latency_us(self) -> dict[str, float]:
        return {
            "lookup_p50_us": self._pct(self.lookup_ns, 50),
            "lookup_p99_us": self._pct(self.lookup_ns, 99),
            "step_p50_us": self._pct(self.step_ns, 50),
            "step_p99_us": self._pct(self.step_ns, 99),
        }

    def to_dict(self) -> dict[str, Any]:
        tiers = ["device", *self.tiers]
        return {
            "options": self.options,
            "geometry": self.geometry,
            "requests": self.requests,
            "block_refs": self.block_refs,
            "prompt_tokens": self.prompt_tokens,
            "hits": {t: self.hits.get(t, 0) for t in tiers},
            "hit_rates": {t: self.hit_rate(t) for t in tiers},
            "total_hit_rate": sum(self.hits.values()) / self.block_refs if self.block_refs else 0.0,
            "computed_blocks": self.computed_blocks,
            "prefill_tokens_saved": self.tokens_saved,
            "prefill_tokens_saved_fraction": self.tokens_saved / self.prompt_tokens if self.prompt_tokens else 0.0,
            "bytes": dict(self.bytes),
            "seconds": dict(self.seconds),
            "tier_job_seconds": dict(self.job_seconds),
            "gbps": {d: self.gbps(d) for d in self.bytes},
            "latency": self.latency_us(),
            "lookups": len(self.lookup_ns),
            "steps": len(self.step_ns),
            "verified_blocks": self.blocks_verified,
            "errors": {
                "total": self.errors,
                "verify_failures": self.verify_failures,
                "transfer_failures": self.transfer_failures,
                "promotion_failures": self.promotion_failures,
                "tier_failures": self.tier_failures,
            },
            "store_rejections": self.store_rejections,
            "tier_stores_shed": self.stores_shed,
            "wall_s": self.wall_s,
            "setup_s": self.setup_s,
            "timeline": [
                {
                    "req_id": r.req_id,
                    "t": r.scheduled_s,
                    "blocks": r.blocks,
                    "device": r.device_hits,
                    **r.tier_hits,
                    "computed": r.computed,
                }
                for r in self.timeline
            ],
            "manager_stats": self.manager_stats,
        }


@dataclass
class _Running:
    """A scheduled request waiting for its copy jobs."""

    req: RequestContext
    load_job: int | None
    store_job: int | None
    load_keys: list[BlockKey]
    load_dslots: list[int]
    store_keys: list[BlockKey]
    pinned_dslots: list[int]


class _DevicePool:
    """The simulated device KV cache: slots, an LRU prefix cache, pins."""

    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        # Page aligned like a real engine's pool: numpy's own 16-byte offset makes loads 1.8x slower.
        self.data = aligned_host_array((num_blocks, block_bytes))
        self.free = list(range(num_blocks - 1, -1, -1))
        self.cache: OrderedDict[BlockKey, int] = OrderedDict()
        self.pins = [0] * num_blocks
        self.loading: set[BlockKey] = set()

    def prefix(self, keys: list[BlockKey]) -> int:
        n = 0
        for key in keys:
            if key not in self.cache:
                break
            n += 1
        return n

    def available(self, protected: set[int]) -> int:
        free = len(self.free)
        return free + sum(1 for s in self.cache.values() if not self.pins[s] and s not in protected)

    def take(self, protected: set[int]) -> int:
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


class Bench:
    """One bench run; see the module docstring. Use :func:`run_bench`."""

    def __init__(
        self,
        options: BenchOptions,
        *,
        progress: Callable[[int, int], None] | None = None,
        metrics: KvtierMetrics | None = None,
    ) -> None:
        self.options = options
        self.progress = progress
        self.metrics = metrics

    def run(self) -> BenchResult:
        opts = self.options
        started = time.perf_counter()
        temp_root: str | None = None
        fs_root = opts.fs_root
        if opts.fs and fs_root is None:
            temp_root = fs_root = tempfile.mkdtemp(prefix="kvtier-bench-")
        try:
            config = opts.config(fs_root)
            namespace = config.namespace()
            requests = generate_chat(opts.workload)
            keys = [
                prefix_keys(r.token_ids, config.kv_geometry().tokens_per_block, namespace=namespace) for r in requests
            ]
            longest = max((len(k) for k in keys), default=0)
            if longest > opts.device_blocks:
                raise ConfigError(
                    f"device_blocks={opts.device_blocks} cannot hold the longest prompt ({longest} blocks): "
                    f"raise --device-blocks to at least {longest}"
                )
            manager = build_manager(config)
            try:
                setup_s = time.perf_counter() - started
                result = self._run(config, namespace, manager, requests, keys)
                result.setup_s = setup_s
            finally:
                manager.shutdown()
        finally:
            if temp_root is not None:
                shutil.rmtree(temp_root, ignore_errors=True)
        result.wall_s = time.perf_counter() - started
        return result

    def _run(
        self,
        config: KvtierConfig,
        namespace: Namespace,
        manager: TieringManager,
        requests: list[ChatRequest],
        keys: list[list[BlockKey]],
    ) -> BenchResult:
        opts = self.options
        geometry = config.kv_geometry()
        block_bytes = geometry.bytes_per_block
        tier_labels = ["cpu"] + [manager.tier_label(i + 1).split(":", 1)[1] for i in range(len(manager.tiers))]
        result = BenchResult(
            options={
                "model": config.model_id,
                "cpu_bytes": config.cpu_bytes,
                "cpu_blocks": manager.primary.num_blocks,
                "device_blocks": opts.device_blocks,
                "policy": config.policy,
                # The temporary fs root is gone after the run: leave it out.
                "tiers": [
                    {k: v for k, v in t.items() if not (k == "root" and "kvtier-bench-" in str(v))}
                    for t in config.tiers
                ],
                "workload": opts.workload.to_dict(),
                "batch_size": opts.batch_size,
            },
            geometry={
                "num_layers": geometry.num_layers,
                "num_kv_heads": geometry.num_kv_heads,
                "head_dim": geometry.head_dim,
                "tokens_per_block": geometry.tokens_per_block,
                "dtype": geometry.dtype,
                "bytes_per_block": block_bytes,
                "namespace": namespace.hexdigest,
            },
            tiers=tier_labels,
            tokens_per_block=geometry.tokens_per_block,
        )
        result.hits = dict.fromkeys(["device", *tier_labels], 0)
        result.bytes = {"device_to_cpu": 0, "cpu_to_device": 0}
        result.seconds = {"device_to_cpu": 0.0, "cpu_to_device": 0.0}
        content = BlockContent(block_bytes, seed=opts.workload.seed)
        pool = _DevicePool(opts.device_blocks, block_bytes)
        rows = manager.rows
        engine = TransferEngine(name="kvtier-bench-transfer")
        jobs: dict[int, tuple[_Running, bool]] = {}
        next_job = 1
        running: dict[str, _Running] = {}
        waiting: list[int] = []
        promoted_from: dict[str, dict[BlockKey, str]] = {}
        stalled_since: dict[int, float] = {}
        nxt = 0
        done = 0
        total = len(requests)
        t0 = time.perf_counter()
        lookup_ns = result.lookup_ns
        step_ns = result.step_ns
        lookup = manager.lookup
        perf = time.perf_counter_ns
        tier_objs = manager.tiers
        tier_busy = [0.0] * len(tier_objs)
        last_step = time.perf_counter()

        def finish(run: _Running) -> None:
            nonlocal done
            if run.load_job is None and run.store_job is None:
                pool.unpin(run.pinned_dslots)
                manager.on_request_finished(run.req)
                del running[run.req.req_id]
                done += 1

        try:
            compute_tokens = 0
            while done < total:
                sched_ns = 0
                progressed = False
                # 1. Completed copies.
                for res in engine.poll():
                    run, is_load = jobs.pop(res.job_id)
                    progressed = True
                    sched_ns += self._complete_job(res, run, is_load, manager, pool, content, result)
                    finish(run)
                # 2. Admit requests (arrival order), up to batch_size new ones per step.
                while nxt < total and len(waiting) < opts.batch_size:
                    waiting.append(nxt)
                    nxt += 1
                still_waiting: list[int] = []
                for idx in waiting:
                    req_keys = keys[idx]
                    req = RequestContext(requests[idx].req_id)
                    if idx not in stalled_since:
                        stalled_since[idx] = time.monotonic()
                        t = perf()
                        manager.on_new_request(req)
                        sched_ns += perf() - t
                    d = pool.prefix(req_keys)
                    if any(k in pool.loading for k in req_keys[d:]):
                        still_waiting.append(idx)
                        continue
                    hits = 0
                    pending = False
                    origin = promoted_from.setdefault(req.req_id, {})
                    for key in req_keys[d:]:
                        before = [t.stats.lookups_hit for t in tier_objs] if tier_objs else None
                        t = perf()
                        answer = lookup(key, req)
                        dt = perf() - t
                        lookup_ns.append(dt)
                        if self.metrics is not None:
                            self.metrics.observe_lookup(dt / 1e9)
                        sched_ns += dt
                        if answer is LookupResult.MISS:
                            break
                        if answer is LookupResult.HIT:
                            if not pending:
                                hits += 1
                            continue
                        pending = True
                        if before is not None and key not in origin:
                            for pos, tier in enumerate(tier_objs):
                                if tier.stats.lookups_hit > before[pos]:
                                    origin[key] = tier_labels[pos + 1]
                                    break
                    if pending:
                        if time.monotonic() - stalled_since[idx] > opts.stall_timeout_s:
                            raise KvtierError(
                                f"request {req.req_id} waited {opts.stall_timeout_s}s for promotions; a tier is stuck"
                            )
                        still_waiting.append(idx)
                        continue
                    need = len(req_keys) - d
                    prefix_slots = [pool.cache[k] for k in req_keys[:d]]
                    protected = set(prefix_slots)
                    if pool.available(protected) < need:
                        still_waiting.append(idx)
                        continue
                    progressed = True
                    for k in req_keys[:d]:
                        pool.cache.move_to_end(k)
                    pool.pin(prefix_slots)
                    run = _Running(req, None, None, [], [], [], list(prefix_slots))
                    running[req.req_id] = run
                    # Loads: CPU -> device for the CPU-tier prefix.
                    load_keys = req_keys[d : d + hits]
                    t = perf()
                    if d:
                        manager.touch(req_keys[:d], req)
                    if load_keys:
                        cpu_slots = manager.prepare_load(load_keys, req)
                    sched_ns += perf() - t
                    if load_keys:
                        dslots = [pool.take(protected) for _ in load_keys]
                        pool.pin(dslots)
                        run.pinned_dslots.extend(dslots)
                        pool.loading.update(load_keys)
                        pairs = [
                            (pool.data[ds], rows[int(cs), :block_bytes])
                            for ds, cs in zip(dslots, cpu_slots, strict=True)
                        ]
                        run.load_job = next_job
                        run.load_keys = list(load_keys)
                        run.load_dslots = dslots
                        jobs[next_job] = (run, True)
                        engine.submit(next_job, pairs)
                        next_job += 1
                    # Prefill: compute the rest into device slots, then store device -> CPU.
                    new_keys = req_keys[d + hits :]
                    new_slots = [pool.take(protected) for _ in new_keys]
                    pool.pin(new_slots)
                    run.pinned_dslots.extend(new_slots)
                    for key, ds in zip(new_keys, new_slots, strict=True):
                        content.fill(key, pool.data[ds])
                        pool.cache[key] = ds
                    if new_keys:
                        t = perf()
                        prepared = manager.prepare_store(new_keys, req)
                        sched_ns += perf() - t
                        if prepared is None:
                            result.store_rejections += 1
                        elif prepared.keys_to_store:
                            where = dict(zip(new_keys, new_slots, strict=True))
                            pairs = [
                                (rows[int(cs), :block_bytes], pool.data[where[k]])
                                for k, cs in zip(prepared.keys_to_store, prepared.slots, strict=True)
                            ]
                            run.store_job = next_job
                            run.store_keys = list(prepared.keys_to_store)
                            jobs[next_job] = (run, False)
                            engine.submit(next_job, pairs)
                            next_job += 1
                    # Account.
                    tier_hits = dict.fromkeys(tier_labels, 0)
                    for key in load_keys:
                        tier_hits[origin.get(key, "cpu")] += 1
                    for label, n in tier_hits.items():
                        result.hits[label] += n
                    result.hits["device"] += d
                    result.computed_blocks += len(new_keys)
                    compute_tokens += len(requests[idx].token_ids) - (d + hits) * geometry.tokens_per_block
                    result.block_refs += len(req_keys)
                    result.prompt_tokens += len(requests[idx].token_ids)
                    result.requests += 1
                    result.timeline.append(
                        RequestRecord(req.req_id, len(req_keys), d, tier_hits, len(new_keys), time.perf_counter() - t0)
                    )
                    promoted_from.pop(req.req_id, None)
                    stalled_since.pop(idx, None)
                    finish(run)
                waiting = still_waiting
                t = perf()
                manager.on_schedule_end()
                sched_ns += perf() - t
                step_ns.append(sched_ns)
                last_step = self._account_busy(manager, tier_busy, last_step)
                if self.metrics is not None:
                    self.metrics.observe_step(sched_ns / 1e9)
                    transfer = {d: (result.bytes[d], result.seconds[d]) for d in ("device_to_cpu", "cpu_to_device")}
                    self.metrics.update(manager, transfer)
                if compute_tokens and opts.prefill_tokens_per_s > 0:
                    time.sleep(compute_tokens / opts.prefill_tokens_per_s)
                    compute_tokens = 0
                if self.progress is not None:
                    self.progress(done, total)
                if not progressed:
                    if engine.has_pending():
                        time.sleep(0.0002)
                    else:
                        time.sleep(0.0005)
            engine.wait(timeout=60)
            for res in engine.poll():  # pragma: no cover - every job was consumed above
                run, is_load = jobs.pop(res.job_id)
                self._complete_job(res, run, is_load, manager, pool, content, result)
            deadline = time.monotonic() + 60
            while manager.has_pending_work():
                if time.monotonic() > deadline:
                    raise KvtierError("secondary tiers still busy 60s after the last request")
                manager.on_schedule_end()
                time.sleep(0.001)
                last_step = self._account_busy(manager, tier_busy, last_step)
        finally:
            engine.shutdown()
        stats = manager.stats()
        result.manager_stats = stats
        result.promotion_failures = int(stats["manager"]["promotions_failed"])
        for pos, (label, tier) in enumerate(stats["tiers"].items()):
            short = label.split(":", 1)[1]
            result.bytes[f"cpu_to_{short}"] = int(tier["bytes_written"])
            result.bytes[f"{short}_to_cpu"] = int(tier["bytes_read"])
            # Cascade jobs queue behind each other on several threads, so their summed
            # seconds would understate the rate: use the wall time with the tier busy.
            # Promotions are served first (read priority): their summed job time is fair.
            result.seconds[f"cpu_to_{short}"] = tier_busy[pos]
            result.seconds[f"{short}_to_cpu"] = float(tier["seconds_reading"])
            result.job_seconds[f"cpu_to_{short}"] = float(tier["seconds_writing"])
            result.job_seconds[f"{short}_to_cpu"] = float(tier["seconds_reading"])
            result.tier_failures += int(tier["stores_failed"]) + int(tier["loads_failed"])
            result.tier_failures += int(tier["corrupt_values"])
            result.stores_shed += int(tier["stores_dropped"])
        if self.progress is not None:
            self.progress(total, total)
        return result

    @staticmethod
    def _account_busy(manager: TieringManager, tier_busy: list[float], last: float) -> float:
        """Add the time since ``last`` to the busy time of tiers with work in flight."""
        now = time.perf_counter()
        for pos, tier in enumerate(manager.tiers):
            if tier.has_pending_work():
                tier_busy[pos] += now - last
        return now

    @staticmethod
    def _complete_job(
        res: TransferResult,
        run: _Running,
        is_load: bool,
        manager: TieringManager,
        pool: _DevicePool,
        content: BlockContent,
        result: BenchResult,
    ) -> int:
        """Consume one finished copy job; returns scheduler-side nanoseconds spent."""
        direction = "cpu_to_device" if is_load else "device_to_cpu"
        if not res.success:
            result.transfer_failures += 1
            logger.error("copy job %d (%s) failed: %s", res.job_id, direction, res.error)
        else:
            result.bytes[direction] += res.bytes_moved
            result.seconds[direction] += res.seconds
        t = time.perf_counter_ns()
        if is_load:
            manager.complete_load(run.load_keys, run.req)
            spent = time.perf_counter_ns() - t
            for key, ds in zip(run.load_keys, run.load_dslots, strict=True):
                pool.loading.discard(key)
                if res.success and content.matches(key, pool.data[ds]):
                    result.blocks_verified += 1
                    pool.cache[key] = ds
                else:
                    if res.success:
                        result.verify_failures += 1
                        logger.error("block %s loaded with wrong bytes", key.hex()[:16])
            run.load_job = None
        else:
            manager.complete_store(run.store_keys, run.req, res.success)
            spent = time.perf_counter_ns() - t
            run.store_job = None
        return spent


def run_bench(
    options: BenchOptions | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
    metrics: KvtierMetrics | None = None,
) -> BenchResult:
    """Run the bench and return its result. Raises :class:`KvtierError` on a setup problem.

    ``metrics`` (optional) is updated every step from the bench's thread.
    """
    return Bench(options or BenchOptions(), progress=progress, metrics=metrics).run()


def options_from_args(**kwargs: Any) -> BenchOptions:
    """BenchOptions from CLI-style values (sizes may be strings such as ``"256MiB"``)."""
    for name in ("cpu_bytes", "fs_bytes"):
        if isinstance(kwargs.get(name), str):
            kwargs[name] = parse_size(kwargs[name])
    return BenchOptions(**kwargs)


def describe_options(options: BenchOptions) -> str:
    """One line for the console: sizes and tiers of the run."""
    base = options.base_config
    if base is not None:
        cpu = format_size(base.resolved_num_cpu_blocks() * base.row_stride)
        tiers = [f"cpu {cpu}"] + [f"{t['type']} {t.get('root') or t.get('url') or ''}".strip() for t in base.tiers]
        model = base.model
    else:
        tiers = ["cpu " + format_size(options.cpu_bytes)]
        model = options.model
    if options.fs:
        tiers.append("fs " + (options.fs_root or "(temp dir)"))
    if options.redis_url:
        tiers.append("redis " + options.redis_url)
    return f"model {model}, device pool {options.device_blocks} blocks, tiers: " + ", ".join(tiers)


__all__ = [
    "DEFAULT_BENCH_CPU_BYTES",
    "Bench",
    "BenchOptions",
    "BenchResult",
    "BlockContent",
    "RequestRecord",
    "describe_options",
    "options_from_args",
    "run_bench",
]
