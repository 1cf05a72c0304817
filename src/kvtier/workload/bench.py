"""``kvtier bench``: a multi-turn chat workload through the whole stack, with real bytes.

The bench plays an inference engine around a real
:class:`~kvtier.manager.TieringManager`:

* a simulated device KV pool (:class:`~kvtier.workload.device.DevicePool`,
  smaller than the working set) with its own LRU prefix cache, as an engine's
  GPU has;
* "prefill" of a block writes bytes derived from its key
  (:class:`~kvtier.workload.device.BlockContent`) into a device slot;
* device <-> CPU copies run on a :class:`~kvtier.transfer.TransferEngine`;
* the manager cascades stored blocks to the secondary tiers (an fs tier in a
  lock-held temporary directory by default) and promotes them back on a hit;
* every block loaded into the device is compared byte for byte with what its
  key must hold; any difference is counted as an error.

A run reads as the workload's story: **build** (configuration, manager, device
pool, copy engine), **warm** (tiers finish starting: warm-restart scans, health),
**run** (engine steps until every request was served), **verify** (drain every
copy and tier job; the last loads are checked) and **report** (counters into a
:class:`BenchResult`). Each secondary tier's health is sampled every step: a
tier that goes out of service (circuit breaker open) is announced through
``notify`` and, with ``BenchOptions.strict``, ends the run with
:class:`TierUnreachableError`.

The scheduler side (every manager call) is timed separately from the copies.
Called from one thread (the caller's), which plays the engine's scheduler; the
transfer engine's and the tiers' threads are started and joined here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvtier.config import KvtierConfig, build_manager, load_config
from kvtier.errors import ConfigError, KvtierError, clear_exception_frames
from kvtier.interrupts import DeferredReleases, interrupts_deferred
from kvtier.keys import BlockKey, prefix_keys
from kvtier.manager import TieringManager
from kvtier.metrics import KvtierMetrics
from kvtier.policies import DEFAULT_POLICY
from kvtier.tempdir import LockedTempDir, sweep_stale_temp_dirs
from kvtier.tiers.registry import shown_tier_options, validate_tier_options
from kvtier.transfer import TransferEngine, TransferResult
from kvtier.types import LookupResult, RequestContext
from kvtier.units import format_size, parse_size
from kvtier.validation import check_seconds
from kvtier.workload.bench_result import BenchResult, RequestRecord, TierWatch
from kvtier.workload.budget import MemoryNeed, check_memory
from kvtier.workload.chat import ChatRequest, ChatWorkloadSpec, generate_chat
from kvtier.workload.device import BlockContent, DevicePool

logger = logging.getLogger(__name__)

DEFAULT_BENCH_CPU_BYTES = 256 * 1024**2
DEFAULT_BENCH_FS_BYTES = 1024**3
DEFAULT_BENCH_MODEL = "qwen2.5-0.5b"
BENCH_DEFAULTS: dict[str, Any] = {"model": DEFAULT_BENCH_MODEL, "cpu_bytes": DEFAULT_BENCH_CPU_BYTES}
"""Where ``kvtier bench`` differs from the schema's defaults (a small model, a 256 MiB CPU tier)."""
MAX_DEVICE_BLOCKS = 1 << 24
"""The most blocks of the simulated device pool (its bytes are checked against memory too)."""
MAX_BATCH_SIZE = 1 << 20
"""The most requests admitted per engine step."""
MIN_PREFILL_RATE = 1.0
MAX_PREFILL_RATE = 1e12
"""Simulated prefill speed bounds in tokens/s (0 means instantaneous): a rate of 1e-300 would sleep forever."""
TEMP_DIR_PREFIX = "kvtier-bench-"
"""Name prefix of the bench's lock-held temporary fs-tier directories (swept by ``kvtier sweep``)."""


class TierUnreachableError(KvtierError):
    """A configured secondary tier was out of service during a ``strict`` bench run."""


def _cpu_size_setting(config: KvtierConfig) -> str:
    """Where the CPU tier's size was given, as a user would change it: ``--cpu-bytes`` (the flag or
    the bench's default), ``KVTIER_CPU_BYTES`` (or ``KVTIER_NUM_CPU_BLOCKS``), or the config file."""
    sources = config.sources
    field = "num_cpu_blocks" if "default" not in sources.get("num_cpu_blocks", "default") else "cpu_bytes"
    source = sources.get(field, "default")
    if source.startswith("environment variable "):
        return source.removeprefix("environment variable ")
    if source.startswith("file "):
        return f"{field} in {source.removeprefix('file ')}"
    return "--cpu-bytes"


@dataclass
class BenchOptions:
    """What ``kvtier bench`` runs. ``fs_root=None`` uses a lock-held temporary directory (removed after).

    Raises :class:`ConfigError` for a value no run can use (zero batch size, ...).
    """

    workload: ChatWorkloadSpec = field(default_factory=ChatWorkloadSpec)
    model: str = DEFAULT_BENCH_MODEL
    tokens_per_block: int = 16
    cpu_bytes: int = DEFAULT_BENCH_CPU_BYTES
    device_blocks: int = 512
    policy: str = DEFAULT_POLICY
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
    strict: bool = False
    """A secondary tier that goes out of service (unreachable) ends the run with an error."""
    temp_dir: str | None = None
    """Parent of the temporary fs-tier directory (default: the system's temporary directory)."""
    tier_order: tuple[str | int, ...] = ()
    """The order of the secondary tiers, by group: ``"config"`` (``base_config``'s tiers), ``"fs"``,
    ``"redis"`` and an index into ``extra_tiers``; groups not named follow in that default order."""

    def __post_init__(self) -> None:
        for name, high in (("device_blocks", MAX_DEVICE_BLOCKS), ("batch_size", MAX_BATCH_SIZE)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ConfigError(f"bench {name} must be a positive integer of at most {high}, got {str(value)[:40]}")
        rate = self.prefill_tokens_per_s
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not (
            rate == 0 or MIN_PREFILL_RATE <= rate <= MAX_PREFILL_RATE
        ):
            raise ConfigError(
                f"bench prefill_tokens_per_s must be 0 (instantaneous) or in [{MIN_PREFILL_RATE:g}, "
                f"{MAX_PREFILL_RATE:g}] tokens/s, got {rate!r}"
            )
        check_seconds(self.stall_timeout_s, "bench stall_timeout_s", positive=True)

    def memory_needs(self, config: KvtierConfig) -> list[MemoryNeed]:
        """What a run of ``config`` (this run's, from :meth:`config`) holds in memory, estimated before
        anything is allocated.

        The device pool (``device_blocks`` rows of a block each), the CPU tier's
        region (in /dev/shm, which is memory too), memory tiers at their capacity,
        and the workload: its prompts at their longest (4 bytes a token) plus a
        block key (about 80 bytes with its list slot) per block of each prompt.
        """
        block = config.block_bytes
        tokens_per_block = config.kv_geometry().tokens_per_block
        region = config.resolved_num_cpu_blocks(block) * config.row_stride
        tokens = self.workload.max_tokens()
        # ``config`` is this run's (:meth:`config`): its tiers already hold the ones the flags add
        # (--memory-tier), so each memory tier is counted once.
        memory_tiers = sum(int(t.get("max_bytes") or 0) for t in config.tiers if t.get("type") == "memory")
        return [
            MemoryNeed("device pool", self.device_blocks * block, "--device-blocks"),
            MemoryNeed("CPU tier", region, _cpu_size_setting(config)),
            MemoryNeed("workload", tokens * 4 + tokens // tokens_per_block * 80, "--sessions/--max-turns"),
            MemoryNeed("memory tier", memory_tiers, "--memory-tier"),
        ]

    def ordered_groups(self) -> list[str | int]:
        """The tier groups in :attr:`tier_order`, then the groups it does not name in the default order."""
        default: list[str | int] = ["config", "fs", "redis", *range(len(self.extra_tiers))]
        named = list(dict.fromkeys(g for g in self.tier_order if g in default))
        return named + [g for g in default if g not in named]

    def _group_tiers(self, group: str | int, fs_root: str | None) -> list[dict[str, Any]]:
        """The tier specs of one group the bench adds (``"config"``: none, the base config has them)."""
        if isinstance(group, int):
            return [self.extra_tiers[group]]
        if group == "fs" and self.fs and fs_root is not None:
            spec: dict[str, Any] = {"type": "fs", "root": fs_root}
            if self.fs_bytes is not None:
                spec["max_bytes"] = self.fs_bytes
            return [spec]
        if group == "redis" and self.redis_url:
            return [{"type": "redis", "url": self.redis_url}]
        return []

    def added_tiers(self, fs_root: str | None) -> list[dict[str, Any]]:
        """The tiers the bench adds (fs, redis, extra) as ``{"type": ..., **options}`` specs, in tier order."""
        return [spec for group in self.ordered_groups() for spec in self._group_tiers(group, fs_root)]

    def config(self, fs_root: str | None) -> KvtierConfig:
        """The :class:`KvtierConfig` of this run (``fs_root``: the resolved fs directory).

        Raises :class:`ConfigError` naming the bad field or tier option.
        """
        added = self.added_tiers(fs_root)
        if self.base_config is not None:
            base = self.base_config
            tiers: list[dict[str, Any]] = []
            for group in self.ordered_groups():
                if group == "config":
                    tiers.extend(base.tiers)
                    continue
                for spec in self._group_tiers(group, fs_root):
                    where = f"tiers[{len(tiers)}]"
                    tiers.append({"type": spec["type"], **validate_tier_options(spec, where=where)})
            return base.model_copy(update={"tiers": tiers})
        values = {
            "cpu_bytes": self.cpu_bytes, "policy": self.policy, "model": self.model,
            "geometry": {"tokens_per_block": self.tokens_per_block}, "shm_dir": self.shm_dir, "tiers": added,
        }  # fmt: skip
        return load_config(env={}, cli=values, cli_source="BenchOptions")


@dataclass
class _Running:
    """A scheduled request waiting for its copy jobs."""

    req: RequestContext
    load_job: int | None = None
    store_job: int | None = None
    load_keys: list[BlockKey] = field(default_factory=list)
    load_dslots: list[int] = field(default_factory=list)
    store_keys: list[BlockKey] = field(default_factory=list)
    pinned_dslots: list[int] = field(default_factory=list)


class _Run:
    """One run's engine simulation: the state of the scheduler loop and its phases after build.

    Built by :class:`Bench` once the manager exists; every method runs on the
    caller's thread (the simulated scheduler).
    """

    def __init__(
        self, bench: Bench, config: KvtierConfig, manager: TieringManager,
        requests: list[ChatRequest], keys: list[list[BlockKey]], engine: TransferEngine,
    ) -> None:  # fmt: skip
        self.opts = bench.options
        self.progress = bench.progress
        self.metrics = bench.metrics
        self.notify = bench.notify
        self.manager = manager
        self.requests = requests
        self.keys = keys
        geometry = config.kv_geometry()
        self.tokens_per_block = geometry.tokens_per_block
        self.block_bytes = geometry.bytes_per_block
        self.tier_labels = ["cpu", *_tier_labels(manager)]
        self.watches = [TierWatch(label) for label in self.tier_labels[1:]]
        self.result = _new_result(config, manager, self.opts, self.tier_labels)
        self.result.tier_health = dict(zip(self.tier_labels[1:], self.watches, strict=True))
        self.content = BlockContent(self.block_bytes, seed=self.opts.workload.seed)
        self.pool = DevicePool(self.opts.device_blocks, self.block_bytes)
        self.engine = engine
        self.jobs: dict[int, tuple[_Running, bool]] = {}
        self.next_job = 1
        self.running: dict[str, _Running] = {}
        self.waiting: list[int] = []
        self.promoted_from: dict[str, dict[BlockKey, str]] = {}
        self.stalled_since: dict[int, float] = {}
        self.admitted = 0
        self.done = 0
        self.compute_tokens = 0
        self.sched_ns = 0
        self.tier_busy = [0.0] * len(manager.tiers)
        self.last_step = time.perf_counter()
        self.t0 = time.perf_counter()
        self.rows: Any = manager.rows  # last: a view of the CPU rows, dropped by close

    # ----------------------------------------------------------------- warm

    def warm(self, timeout_s: float) -> None:
        """Let the tiers finish starting: warm-restart scans done, health known (strict: up to 1 s)."""
        deadline = time.monotonic() + timeout_s
        while any(not getattr(t, "scan_complete", True) for t in self.manager.tiers):
            if time.monotonic() > deadline:
                raise KvtierError(f"secondary tiers still scanning their directories after {timeout_s:.0f}s")
            time.sleep(0.01)
        probe_until = time.monotonic() + (1.0 if self.opts.strict else 0.0)
        while True:
            self.watch_tiers()
            if time.monotonic() >= probe_until or any(w.unreachable for w in self.watches):
                break
            time.sleep(0.02)

    def watch_tiers(self) -> None:
        """Sample every tier's health; announce (or, strict, refuse) one that went out of service."""
        for tier, watch in zip(self.manager.tiers, self.watches, strict=True):
            if not watch.sample(tier):
                continue
            what = f"tier {tier.label} is unreachable: circuit breaker open ({watch.detail or 'no detail'})"
            if self.opts.strict:
                raise TierUnreachableError(f"{what}; --strict refuses to run without a configured tier")
            if self.notify is not None:
                self.notify(
                    f"{what}; its lookups answer MISS and its stores are dropped until it recovers "
                    "(--strict makes this an error)"
                )

    # ----------------------------------------------------------------- run

    def run(self) -> None:
        """Engine steps until every request has been scheduled and its copies consumed."""
        total = len(self.requests)
        while self.done < total:
            self.sched_ns = 0
            progressed = self.consume_copies()
            while self.admitted < total and len(self.waiting) < self.opts.batch_size:
                self.waiting.append(self.admitted)
                self.admitted += 1
            still_waiting = []
            for idx in self.waiting:
                if self.schedule(idx):
                    progressed = True
                else:
                    still_waiting.append(idx)
            self.waiting = still_waiting
            self.end_step()
            if self.progress is not None:
                self.progress(self.done, total)
            if not progressed:
                time.sleep(0.0002 if self.engine.has_pending() else 0.0005)

    def consume_copies(self) -> bool:
        """Complete the copy jobs the engine finished; True if there were any."""
        finished = self.engine.poll()
        for res in finished:
            run, is_load = self.jobs.pop(res.job_id)
            self.complete_copy(res, run, is_load)
            self.finish(run)
        return bool(finished)

    def finish(self, run: _Running) -> None:
        if run.load_job is None and run.store_job is None:
            self.pool.unpin(run.pinned_dslots)
            self.manager.on_request_finished(run.req)
            del self.running[run.req.req_id]
            self.done += 1

    def timed(self, call: Callable[[], Any]) -> Any:
        """Run a scheduler-side manager call, adding its time to this step's."""
        t = time.perf_counter_ns()
        out = call()
        self.sched_ns += time.perf_counter_ns() - t
        return out

    def schedule(self, idx: int) -> bool:
        """Try to schedule request ``idx``: False while it must wait (promotions, loads, device room)."""
        req_keys = self.keys[idx]
        req = RequestContext(self.requests[idx].req_id)
        if idx not in self.stalled_since:
            self.stalled_since[idx] = time.monotonic()
            self.timed(lambda: self.manager.on_new_request(req))
        pool = self.pool
        d = pool.prefix(req_keys)
        if any(k in pool.loading for k in req_keys[d:]):
            return False
        hits, pending = self.lookup_prefix(req, req_keys[d:])
        if pending:
            if time.monotonic() - self.stalled_since[idx] > self.opts.stall_timeout_s:
                raise KvtierError(
                    f"request {req.req_id} waited {self.opts.stall_timeout_s}s for promotions; a tier is stuck"
                )
            return False
        prefix_slots = [pool.cache[k] for k in req_keys[:d]]
        protected = set(prefix_slots)
        if pool.available(protected) < len(req_keys) - d:
            return False
        for k in req_keys[:d]:
            pool.cache.move_to_end(k)
        pool.pin(prefix_slots)
        run = _Running(req, pinned_dslots=list(prefix_slots))
        self.running[req.req_id] = run
        load_keys = req_keys[d : d + hits]
        self.start_loads(run, req_keys[:d], load_keys, protected)
        new_keys = req_keys[d + hits :]
        self.prefill_and_store(run, new_keys, protected)
        self.account(idx, run, d, load_keys, new_keys)
        self.finish(run)
        return True

    def lookup_prefix(self, req: RequestContext, keys: list[BlockKey]) -> tuple[int, bool]:
        """Ask the manager about ``keys`` in order: (leading HITs, whether any answer means "wait")."""
        hits = 0
        pending = False
        origin = self.promoted_from.setdefault(req.req_id, {})
        manager = self.manager
        lookup = manager.lookup
        perf = time.perf_counter_ns
        lookup_ns = self.result.lookup_ns
        for key in keys:
            t = perf()
            answer = lookup(key, req)
            dt = perf() - t
            lookup_ns.append(dt)
            self.sched_ns += dt
            if self.metrics is not None:
                self.metrics.observe_lookup(dt / 1e9)
            if answer is LookupResult.MISS:
                break
            if answer is LookupResult.HIT:
                hits += 0 if pending else 1
                continue
            pending = True
            if manager.promoted_from and key not in origin:  # this lookup started a promotion from that tier
                origin[key] = self.tier_labels[manager.promoted_from]
        return hits, pending

    def submit_copy(self, run: _Running, pairs: list[tuple[Any, Any]], is_load: bool) -> int:
        job = self.next_job
        self.next_job += 1
        self.jobs[job] = (run, is_load)
        self.engine.submit(job, pairs)
        return job

    def start_loads(
        self, run: _Running, device_prefix: list[BlockKey], load_keys: list[BlockKey], protected: set[int]
    ) -> None:
        """Pin the CPU-tier hits and copy them into device slots (the device prefix only gets touched)."""
        req, pool = run.req, self.pool
        if device_prefix:
            self.timed(lambda: self.manager.touch(device_prefix, req))
        if not load_keys:
            return
        cpu_slots = self.timed(lambda: self.manager.prepare_load(load_keys, req))
        dslots = [pool.take(protected) for _ in load_keys]
        pool.pin(dslots)
        run.pinned_dslots.extend(dslots)
        pool.loading.update(load_keys)
        rows, block_bytes = self.rows, self.block_bytes
        pairs = [(pool.data[ds], rows[int(cs), :block_bytes]) for ds, cs in zip(dslots, cpu_slots, strict=True)]
        run.load_keys = list(load_keys)
        run.load_dslots = dslots
        run.load_job = self.submit_copy(run, pairs, is_load=True)

    def prefill_and_store(self, run: _Running, new_keys: list[BlockKey], protected: set[int]) -> None:
        """Compute the missing blocks into device slots, then offload them device -> CPU."""
        pool = self.pool
        new_slots = [pool.take(protected) for _ in new_keys]
        pool.pin(new_slots)
        run.pinned_dslots.extend(new_slots)
        for key, ds in zip(new_keys, new_slots, strict=True):
            self.content.fill(key, pool.data[ds])
            pool.cache[key] = ds
        if not new_keys:
            return
        prepared = self.timed(lambda: self.manager.prepare_store(new_keys, run.req))
        if prepared is None:
            self.result.store_rejections += 1
        elif prepared.keys_to_store:
            where = dict(zip(new_keys, new_slots, strict=True))
            pairs = [
                (self.rows[int(cs), : self.block_bytes], pool.data[where[k]])
                for k, cs in zip(prepared.keys_to_store, prepared.slots, strict=True)
            ]
            run.store_keys = list(prepared.keys_to_store)
            run.store_job = self.submit_copy(run, pairs, is_load=False)

    def account(
        self, idx: int, run: _Running, device_hits: int, load_keys: list[BlockKey], new_keys: list[BlockKey]
    ) -> None:
        """Count a scheduled request: hits per tier, blocks computed, tokens to prefill."""
        result, req = self.result, run.req
        origin = self.promoted_from.pop(req.req_id, {})
        tier_hits = dict.fromkeys(self.tier_labels, 0)
        for key in load_keys:
            tier_hits[origin.get(key, "cpu")] += 1
        for label, n in tier_hits.items():
            result.hits[label] += n
        result.hits["device"] += device_hits
        result.computed_blocks += len(new_keys)
        tokens = len(self.requests[idx].token_ids)
        self.compute_tokens += tokens - (device_hits + len(load_keys)) * self.tokens_per_block
        result.block_refs += len(self.keys[idx])
        result.prompt_tokens += tokens
        result.requests += 1
        elapsed = time.perf_counter() - self.t0
        result.timeline.append(
            RequestRecord(req.req_id, len(self.keys[idx]), device_hits, tier_hits, len(new_keys), elapsed)
        )
        self.stalled_since.pop(idx, None)

    def end_step(self) -> None:
        """Close an engine step: the manager's step end, tier health, metrics, simulated compute time."""
        self.timed(self.manager.on_schedule_end)
        self.result.step_ns.append(self.sched_ns)
        self.account_busy()
        self.watch_tiers()
        if self.metrics is not None:
            self.metrics.observe_step(self.sched_ns / 1e9)
            result = self.result
            transfer = {d: (result.bytes[d], result.seconds[d]) for d in ("device_to_cpu", "cpu_to_device")}
            self.metrics.update(self.manager, transfer)
        if self.compute_tokens and self.opts.prefill_tokens_per_s > 0:
            time.sleep(self.compute_tokens / self.opts.prefill_tokens_per_s)
            self.compute_tokens = 0

    def account_busy(self) -> None:
        """Add the time since the last call to the busy time of tiers with work in flight."""
        now = time.perf_counter()
        for pos, tier in enumerate(self.manager.tiers):
            if tier.has_pending_work():
                self.tier_busy[pos] += now - self.last_step
        self.last_step = now

    def complete_copy(self, res: TransferResult, run: _Running, is_load: bool) -> None:
        """Consume one finished copy job; a load's blocks are checked byte for byte here."""
        result = self.result
        direction = "cpu_to_device" if is_load else "device_to_cpu"
        if not res.success:
            result.transfer_failures += 1
            logger.error("copy job %d (%s) failed: %s", res.job_id, direction, res.error)
        else:
            result.bytes[direction] += res.bytes_moved
            result.seconds[direction] += res.seconds
        if not is_load:
            self.timed(lambda: self.manager.complete_store(run.store_keys, run.req, res.success))
            run.store_job = None
            return
        self.timed(lambda: self.manager.complete_load(run.load_keys, run.req))
        for key, ds in zip(run.load_keys, run.load_dslots, strict=True):
            self.pool.loading.discard(key)
            if not res.success:
                continue
            if self.content.matches(key, self.pool.data[ds]):
                result.blocks_verified += 1
                self.pool.cache[key] = ds
            else:
                result.verify_failures += 1
                logger.error("block %s loaded with wrong bytes", key.hex()[:16])
        run.load_job = None

    def close(self) -> None:
        """Stop the copy engine and drop every view of the CPU rows (before the manager shuts down)."""
        self.engine.shutdown()
        self.rows = None
        self.jobs.clear()
        self.running.clear()

    # ----------------------------------------------------------------- verify and report

    def verify(self, timeout_s: float = 60.0) -> None:
        """Drain: the last copies (loads verified as they complete), then every tier job."""
        self.engine.wait(timeout=timeout_s)
        self.consume_copies()
        deadline = time.monotonic() + timeout_s
        while self.manager.has_pending_work():
            if time.monotonic() > deadline:
                raise KvtierError(f"secondary tiers still busy {timeout_s:.0f}s after the last request")
            self.manager.on_schedule_end()
            time.sleep(0.001)
            self.account_busy()
        self.watch_tiers()

    def report(self) -> BenchResult:
        """Fold the manager's and tiers' counters into the result."""
        result = self.result
        stats = self.manager.stats()
        result.manager_stats = stats.as_dict()
        result.promotion_failures = stats.manager.promotions_failed
        for pos, tier in enumerate(stats.secondary):
            short = self.tier_labels[tier.index]
            result.bytes[f"cpu_to_{short}"] = tier.written.bytes
            result.bytes[f"{short}_to_cpu"] = tier.read.bytes
            # Cascade jobs queue behind each other on several threads, so their summed
            # seconds would understate the rate: use the wall time with the tier busy.
            # Promotions are served first (read priority): their summed job time is fair.
            result.seconds[f"cpu_to_{short}"] = self.tier_busy[pos]
            result.seconds[f"{short}_to_cpu"] = tier.read.seconds
            result.job_seconds[f"cpu_to_{short}"] = tier.written.seconds
            result.job_seconds[f"{short}_to_cpu"] = tier.read.seconds
            failures = tier.failures
            failed = failures["store_failed"] + failures["load_failed"] + failures["corrupt_value"]
            result.tier_failures += failed
            last_error = self.manager.telemetry[pos + 1].last_error
            if failed or tier.failures.get("promotion_job_failed"):
                result.tier_errors[short] = last_error or f"{failed} job(s) failed without a reason given"
            result.stores_shed += failures["store_dropped"]
            if tier.backpressure is not None and tier.backpressure.skipped_blocks:
                result.stores_skipped[short] = tier.backpressure.skipped_blocks
        if self.progress is not None:
            self.progress(len(self.requests), len(self.requests))
        return result


def _tier_labels(manager: TieringManager) -> list[str]:
    """One distinct label per secondary tier, in tier order: its type (``"fs"``) when no other
    secondary tier has that type, else the tier's own ``"<n>:<type>"`` label (``"1:fs"``, ``"2:fs"``),
    so two tiers of one type never share a row or a JSON key."""
    tiers = manager.tier_descriptors()[1:]
    types = [tier.tier_type for tier in tiers]
    labels = [t if types.count(t) == 1 and t != "cpu" else tier.label for t, tier in zip(types, tiers, strict=True)]
    if len(set(labels)) != len(labels):  # a custom tier type that looks like another tier's label
        labels = [tier.label for tier in tiers]
    return labels


def _new_result(config: KvtierConfig, manager: TieringManager, opts: BenchOptions, labels: list[str]) -> BenchResult:
    geometry = config.kv_geometry()
    result = BenchResult(
        options={
            "model": config.model_id,
            "cpu_bytes": config.cpu_bytes,
            "cpu_blocks": manager.primary.num_blocks,
            "device_blocks": opts.device_blocks,
            "device_pool_bytes": opts.device_blocks * geometry.bytes_per_block,
            "policy": config.policy,
            # The temporary fs root is gone after the run: leave it out.
            # Shown form: a password in a URL or a secret key never reaches the JSON.
            "tiers": [
                {k: v for k, v in shown_tier_options(t).items() if not (k == "root" and TEMP_DIR_PREFIX in str(v))}
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
            "bytes_per_block": geometry.bytes_per_block,
            "namespace": config.namespace().hexdigest,
        },
        tiers=labels,
        tokens_per_block=geometry.tokens_per_block,
    )
    result.hits = dict.fromkeys(["device", *labels], 0)
    result.bytes = {"device_to_cpu": 0, "cpu_to_device": 0}
    result.seconds = {"device_to_cpu": 0.0, "cpu_to_device": 0.0}
    return result


class Bench:
    """One bench run; see the module docstring. Use :func:`run_bench`.

    ``progress(done, total)`` is called once per engine step and ``notify(line)``
    for events a user should see (a tier going out of service), both from the
    caller's thread.
    """

    def __init__(
        self,
        options: BenchOptions,
        *,
        progress: Callable[[int, int], None] | None = None,
        metrics: KvtierMetrics | None = None,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.options = options
        self.progress = progress
        self.metrics = metrics
        self.notify = notify

    def run(self) -> BenchResult:
        """Check memory, then build, warm, run, verify, report; the manager and any temporary directory
        are always released. Raises :class:`ConfigError` before allocating anything when the run
        would not fit in the memory available (:mod:`kvtier.workload.budget`)."""
        started = time.perf_counter()
        plain = self.options.config(None)
        check_memory(self.options.memory_needs(plain))
        # Refuse a prompt the device pool cannot hold now, not after hashing the whole workload.
        requests = self._requests(plain.kv_geometry().tokens_per_block)
        # Each step that acquires something registers its release before an interrupt may land
        # (kvtier.interrupts), and the releases run in reverse, all of them, held back from one.
        with DeferredReleases() as releases:
            scratch = None
            if self.options.fs and self.options.fs_root is None:
                self._sweep_temp_fs_dirs()
                with interrupts_deferred():
                    scratch = LockedTempDir(TEMP_DIR_PREFIX, self.options.temp_dir)
                    releases.callback(scratch.cleanup)
            fs_root = self.options.fs_root or (str(scratch.path / "fs") if scratch is not None else None)
            config = self.options.config(fs_root)
            keys = self._keys(config, requests)
            with interrupts_deferred():
                manager = build_manager(config)
                releases.callback(manager.shutdown)
            with interrupts_deferred():
                engine = TransferEngine(name="kvtier-bench-transfer")
                releases.callback(engine.shutdown)
            run: _Run | None = None
            try:
                with interrupts_deferred():
                    run = _Run(self, config, manager, requests, keys, engine)
                    releases.callback(run.close)
                run.warm(timeout_s=self.options.stall_timeout_s)
                run.result.setup_s = time.perf_counter() - started
                run.run()
                run.verify()
            except BaseException as exc:
                # The frames of the failed step hold views of the CPU rows (copy pairs);
                # the region cannot be released while they live, so drop them first.
                # (An interrupt inside _Run(), with no deferral in force (a library caller), leaves
                # its half-built object to these frames and to ``run``: dropped with them.)
                with interrupts_deferred():
                    clear_exception_frames(exc)
                    run = None
                raise
            result = run.report()
        result.wall_s = time.perf_counter() - started
        return result

    def _sweep_temp_fs_dirs(self) -> None:
        """Remove the temporary directories of benches that died (lock not held)."""
        for stale in sweep_stale_temp_dirs(TEMP_DIR_PREFIX, self.options.temp_dir, remove=True):
            logger.info("removed %s left by a bench that died (%s)", stale.path, format_size(stale.size))

    def _requests(self, tokens_per_block: int) -> list[ChatRequest]:
        """The workload's requests; raises :class:`ConfigError` when the longest prompt needs more
        full blocks than ``device_blocks`` (checked by token count alone, so before any hashing)."""
        requests = generate_chat(self.options.workload)
        longest = max((len(r.token_ids) // tokens_per_block for r in requests), default=0)
        if longest > self.options.device_blocks:
            raise ConfigError(
                f"device_blocks={self.options.device_blocks} cannot hold the longest prompt ({longest} blocks): "
                f"raise --device-blocks to at least {longest}"
            )
        return requests

    @staticmethod
    def _keys(config: KvtierConfig, requests: list[ChatRequest]) -> list[list[BlockKey]]:
        """The block keys of every request's full blocks, under ``config``'s namespace."""
        namespace = config.namespace()
        tokens_per_block = config.kv_geometry().tokens_per_block
        return [prefix_keys(r.token_ids, tokens_per_block, namespace=namespace) for r in requests]


def run_bench(
    options: BenchOptions | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
    metrics: KvtierMetrics | None = None,
    notify: Callable[[str], None] | None = None,
) -> BenchResult:
    """Run the bench and return its result.

    Raises :class:`ConfigError` for a configuration no run can use,
    :class:`TierUnreachableError` when ``options.strict`` and a tier goes out
    of service, and :class:`KvtierError` for other setup problems.
    ``metrics`` (optional) is updated every step from the bench's thread.
    """
    return Bench(options or BenchOptions(), progress=progress, metrics=metrics, notify=notify).run()


def options_from_args(**kwargs: Any) -> BenchOptions:
    """BenchOptions from CLI-style values (sizes may be strings such as ``"256MiB"``)."""
    for name in ("cpu_bytes", "fs_bytes"):
        if isinstance(kwargs.get(name), str):
            kwargs[name] = parse_size(kwargs[name])
    return BenchOptions(**kwargs)


def _where(spec: dict[str, Any]) -> str:
    """Where a tier keeps its data, for the console: a directory, or a URL without its credentials."""
    if spec.get("root"):
        return str(spec["root"])
    if spec.get("bucket"):
        return f"s3://{spec['bucket']}/{spec.get('prefix', 'kvtier')}"
    url = spec.get("url")
    if not isinstance(url, str):
        return ""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"


def describe_options(options: BenchOptions) -> str:
    """One line for the console: sizes and tiers of the run (no credentials)."""
    base = options.base_config
    if base is not None:
        cpu = format_size(base.cpu_bytes) if base.cpu_bytes is not None else f"{base.num_cpu_blocks} blocks"
        tiers = [f"cpu {cpu}"]
        model, policy = base.model, base.policy
    else:
        tiers = ["cpu " + format_size(options.cpu_bytes)]
        model, policy = options.model, options.policy
    pool = format_size(options.device_blocks * options.config(None).block_bytes)
    for group in options.ordered_groups():
        if group == "config" and base is not None:
            tiers += [f"{t['type']} {_where(t)}".strip() for t in base.tiers]
        elif group == "fs" and options.fs:
            tiers.append("fs " + (options.fs_root or "(temp dir)"))
        elif group == "redis" and options.redis_url:
            tiers.append("redis " + _where({"url": options.redis_url}))
        elif isinstance(group, int):
            tiers.append(f"{options.extra_tiers[group]['type']} {_where(options.extra_tiers[group])}".strip())
    return (
        f"model {model}, policy {policy}, device pool {options.device_blocks} blocks ({pool}), tiers: "
        + ", ".join(tiers)
    )


__all__ = [
    "BENCH_DEFAULTS",
    "DEFAULT_BENCH_CPU_BYTES",
    "MAX_BATCH_SIZE",
    "MAX_DEVICE_BLOCKS",
    "MAX_PREFILL_RATE",
    "MIN_PREFILL_RATE",
    "TEMP_DIR_PREFIX",
    "Bench",
    "BenchOptions",
    "BenchResult",
    "BlockContent",
    "RequestRecord",
    "TierUnreachableError",
    "TierWatch",
    "describe_options",
    "options_from_args",
    "run_bench",
]
