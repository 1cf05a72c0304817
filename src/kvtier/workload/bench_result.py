"""What ``kvtier bench`` measured: per-request records, per-tier health, the whole result.

Plain data filled in by :mod:`kvtier.workload.bench` on its one thread and
rendered by :mod:`kvtier.workload.report`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.tiers.base import HealthState, SecondaryTier


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
class TierWatch:
    """One secondary tier's health over the run, sampled once per engine step.

    Dropped stores are attributed to their cause by the tier's state when they
    were counted: while the circuit breaker is open the tier sheds every store
    ("out of service"); otherwise by the tier's own count of the stores it shed
    because its write queue was full (``stats.extra["stores_shed_queue_full"]``),
    the rest found no room (every value it could evict was being read, or an fs
    tier shared by engines lost a race for a value's name).
    """

    label: str
    steps: int = 0
    steps_out_of_service: int = 0
    detail: str = ""
    state: str = HealthState.CLOSED.value
    dropped_out_of_service: int = 0
    dropped_queue_full: int = 0
    dropped_no_room: int = 0
    _last_dropped: int = 0
    _last_shed: int = 0
    _was_out: bool = False

    def sample(self, tier: SecondaryTier) -> bool:
        """Read the tier's health and drop counter (scheduler thread); True when it just went out of service."""
        health = tier.health()
        out = not health.serving
        dropped = tier.stats.stores_dropped
        delta, self._last_dropped = dropped - self._last_dropped, dropped
        shed = int(tier.stats.extra.get("stores_shed_queue_full", 0))
        shed_delta, self._last_shed = shed - self._last_shed, shed
        if delta:
            if out or self._was_out:
                self.dropped_out_of_service += delta
            else:
                full = min(shed_delta, delta)
                self.dropped_queue_full += full
                self.dropped_no_room += delta - full
        self.steps += 1
        self.state = health.state.value
        if out:
            self.steps_out_of_service += 1
            self.detail = health.detail or self.detail
        went_out = out and not self._was_out
        self._was_out = out
        return went_out

    @property
    def unreachable(self) -> bool:
        """True if the tier was out of service (breaker open) at any sampled step."""
        return self.steps_out_of_service > 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "state_at_end": self.state,
            "steps_out_of_service": self.steps_out_of_service,
            "steps": self.steps,
            "detail": self.detail,
            "stores_dropped_out_of_service": self.dropped_out_of_service,
            "stores_shed_queue_full": self.dropped_queue_full,
            "stores_dropped_no_room": self.dropped_no_room,
        }


def _plain(text: str) -> str:
    """A tier's error text without Python's ``[Errno N]`` prefixes."""
    return re.sub(r"\[Errno -?\d+\]\s*", "", text)


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
    stores_skipped: dict[str, int] = field(default_factory=dict)
    """Per secondary tier (by short label): blocks not cascaded to it under backpressure."""
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
    tier_health: dict[str, TierWatch] = field(default_factory=dict)
    """Per secondary tier (by short label, e.g. ``"fs"``): health and dropped stores by cause."""
    tier_errors: dict[str, str] = field(default_factory=dict)
    """Per secondary tier with failed jobs (by short label): the tier's own words for the latest failure."""

    @property
    def errors(self) -> int:
        return self.verify_failures + self.transfer_failures + self.promotion_failures + self.tier_failures

    @property
    def unreachable_tiers(self) -> list[str]:
        """Labels of the tiers that were out of service (breaker open) during the run."""
        return [label for label, watch in self.tier_health.items() if watch.unreachable]

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

    def _hits_dict(self) -> dict[str, Any]:
        tiers = ["device", *self.tiers]
        return {
            "hits": {t: self.hits.get(t, 0) for t in tiers},
            "hit_rates": {t: self.hit_rate(t) for t in tiers},
            "total_hit_rate": sum(self.hits.values()) / self.block_refs if self.block_refs else 0.0,
            "computed_blocks": self.computed_blocks,
            "prefill_tokens_saved": self.tokens_saved,
            "prefill_tokens_saved_fraction": self.tokens_saved / self.prompt_tokens if self.prompt_tokens else 0.0,
        }

    def _errors_dict(self) -> dict[str, Any]:
        return {
            "total": self.errors,
            "verify_failures": self.verify_failures,
            "transfer_failures": self.transfer_failures,
            "promotion_failures": self.promotion_failures,
            "tier_failures": self.tier_failures,
            "tier_errors": dict(self.tier_errors),
        }

    def error_lines(self) -> list[str]:
        """What failed, one line per cause (empty when :attr:`errors` is 0): what a user reads on exit 1."""
        lines = []
        if self.verify_failures:
            lines.append(
                f"{self.verify_failures} loaded block(s) had wrong bytes: kvtier served wrong KV, which is a bug; "
                "please report it with the --json output"
            )
        if self.transfer_failures:
            lines.append(f"{self.transfer_failures} device<->CPU copy job(s) failed (the log above says why)")
        if self.tier_failures or self.promotion_failures:
            failed = f"{self.tier_failures} tier job(s) failed" if self.tier_failures else ""
            lost = f"{self.promotion_failures} block(s) could not be loaded back" if self.promotion_failures else ""
            lines.append("; ".join(x for x in (failed, lost) if x) + " (computed again instead; no wrong bytes)")
            for label, error in self.tier_errors.items():
                lines.append(f"{label} tier failed: {_plain(error)}")
        return lines


    @staticmethod
    def _timeline_entry(r: RequestRecord) -> dict[str, Any]:
        return {
            "req_id": r.req_id,
            "t": r.scheduled_s,
            "blocks": r.blocks,
            "device": r.device_hits,
            **r.tier_hits,
            "computed": r.computed,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "options": self.options,
            "geometry": self.geometry,
            "requests": self.requests,
            "block_refs": self.block_refs,
            "prompt_tokens": self.prompt_tokens,
            **self._hits_dict(),
            "bytes": dict(self.bytes),
            "seconds": dict(self.seconds),
            "tier_job_seconds": dict(self.job_seconds),
            "gbps": {d: self.gbps(d) for d in self.bytes},
            "latency": self.latency_us(),
            "lookups": len(self.lookup_ns),
            "steps": len(self.step_ns),
            "verified_blocks": self.blocks_verified,
            "errors": self._errors_dict(),
            "store_rejections": self.store_rejections,
            "tier_stores_shed": self.stores_shed,
            "tier_stores_skipped_backpressure": dict(self.stores_skipped),
            "tier_health": {label: watch.to_dict() for label, watch in self.tier_health.items()},
            "wall_s": self.wall_s,
            "setup_s": self.setup_s,
            "timeline": [self._timeline_entry(r) for r in self.timeline],
            "manager_stats": self.manager_stats,
        }
