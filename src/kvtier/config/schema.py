"""The configuration schema: one pydantic model for the whole stack.

:class:`KvtierConfig` validates every field; secondary-tier entries are
validated through the tier registry (:mod:`kvtier.tiers.registry`), so
out-of-tree tiers are checked exactly like built-in ones. Derived values
(geometry, namespace, CPU rows) are methods of the config.

Pure (no global state); any thread.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvtier.backpressure import MAX_WARMUP_JOBS, BackpressureSettings
from kvtier.config.presets import MODEL_PRESETS, find_preset
from kvtier.errors import ConfigError, RegionError
from kvtier.keys import KVGeometry, Namespace, dtype_bytes
from kvtier.manager import build
from kvtier.manager.waits import (
    DEFAULT_FAILED_LOAD_SECONDS,
    DEFAULT_WAIT_TIMEOUT,
    FAILED_LOAD_SECONDS_RANGE,
    WAIT_TIMEOUT_RANGE,
)
from kvtier.units import parse_size, row_stride_for, rows_that_fit
from kvtier.validation import NOT_A_BOOL, NoBoolNumbers, PositiveSeconds, Seconds

DEFAULT_CPU_BYTES = 4 * 1024**3


MAX_LAYOUT_COUNT = 1 << 16
"""The largest ``num_layers``, ``num_kv_heads``, ``head_dim`` and ``tokens_per_block`` accepted (65536)."""

MAX_CPU_BLOCKS = build.MAX_CPU_BLOCKS
"""The largest ``num_cpu_blocks`` accepted (the manager's own bound, :data:`kvtier.manager.build.MAX_CPU_BLOCKS`)."""

WaitSeconds = Annotated[
    float, NOT_A_BOOL, Field(ge=WAIT_TIMEOUT_RANGE[0], le=WAIT_TIMEOUT_RANGE[1], allow_inf_nan=False)
]
"""``wait_timeout``: a millisecond to an hour."""

HoldSeconds = Annotated[
    float, NOT_A_BOOL, Field(ge=FAILED_LOAD_SECONDS_RANGE[0], le=FAILED_LOAD_SECONDS_RANGE[1], allow_inf_nan=False)
]
"""``failed_load_seconds``: a second to a day."""


class GeometryConfig(NoBoolNumbers):
    """KV block layout; any field left out is taken from the ``model`` preset."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_layers: int | None = Field(
        default=None, gt=0, le=MAX_LAYOUT_COUNT, description="Attention layers held by this rank."
    )
    num_kv_heads: int | None = Field(
        default=None, gt=0, le=MAX_LAYOUT_COUNT, description="KV heads per layer held by this rank."
    )
    head_dim: int | None = Field(default=None, gt=0, le=MAX_LAYOUT_COUNT, description="Elements per head (per token).")
    tokens_per_block: int | None = Field(
        default=None, gt=0, le=MAX_LAYOUT_COUNT,
        description="Tokens per KV block (the engine's block size). Default 16.",
    )
    dtype: str | None = Field(
        default=None, description="KV element type, e.g. bfloat16, float16, fp8. Default bfloat16."
    )
    kv_factor: Literal[1, 2] | None = Field(
        default=None,
        description="2 when K and V are stored separately, 1 for a latent (MLA) cache.",
    )

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str | None) -> str | None:
        if value is not None:
            dtype_bytes(value)
        return value


class BackpressureConfig(NoBoolNumbers):
    """Latency-aware backpressure on cascades (see ``kvtier.backpressure``): per secondary tier,
    a moving average of its store-job latency; above ``high_seconds`` new cascades to the tier are
    skipped, below ``low_seconds`` they resume. Loads and promotions are never shed."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = Field(default=True, description="Watch store latency and skip cascades to slow tiers.")
    high_seconds: PositiveSeconds = Field(
        default=1.0, description="Average store-job latency (submit to completion) above which cascades stop."
    )
    low_seconds: Seconds = Field(
        default=0.5, description="Average store-job latency below which cascades resume (< high_seconds)."
    )
    warmup_jobs: int = Field(
        default=3, ge=1, le=MAX_WARMUP_JOBS,
        description="Store jobs whose mean seeds the average (1 to 10000); no pressure is signalled before.",
    )
    smoothing: float = Field(
        default=0.3, gt=0, le=1, description="Weight of the newest job in the moving average, in (0, 1]."
    )

    @model_validator(mode="after")
    def _marks_ordered(self) -> BackpressureConfig:
        if self.low_seconds >= self.high_seconds:
            raise ValueError(
                f"low_seconds ({self.low_seconds}) must be below high_seconds ({self.high_seconds}): "
                "cascades stop above the high mark and resume below the low one"
            )
        return self

    def settings(self) -> BackpressureSettings:
        """The manager's form of these settings."""
        return BackpressureSettings(**self.model_dump())


def _validate_tier(index: int, spec: Any) -> dict[str, Any]:
    """One ``tiers`` entry validated by the tier registry, as ``{"type": ..., **options}``."""
    from kvtier.tiers.registry import validate_tier_options

    try:
        options = validate_tier_options(spec, where=f"tiers[{index}]")
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return {"type": spec["type"], **options}


def _one_tier_per_root(tiers: list[dict[str, Any]]) -> None:
    """Refuse two fs tiers on one directory (the same real path): they would share one namespace
    directory and its files under two budgets, each evicting the other's blocks."""
    seen: dict[str, int] = {}
    for i, tier in enumerate(tiers):
        if tier["type"] != "fs":
            continue
        where = os.path.realpath(os.path.abspath(tier["root"]))
        if where in seen:
            raise ValueError(f"tiers[{seen[where]}] and tiers[{i}] are both fs tiers on {where}: one directory holds "
                             "one tier; give each its own root")  # fmt: skip
        seen[where] = i


def _known_policies() -> list[str] | None:
    try:
        from kvtier.policies import POLICIES
    except ImportError:
        return None
    return sorted(POLICIES)


class KvtierConfig(NoBoolNumbers):
    """The whole kvtier configuration. See ``docs/configuration.md`` for every field."""

    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)

    cpu_bytes: int | None = Field(
        default=None,
        gt=0,
        lt=2**63,  # (as every size: parse_size)
        description=(
            "Size of the CPU tier in /dev/shm, in bytes or as '4GiB'/'512MiB'. "
            "Default 4GiB when num_cpu_blocks is not set either."
        ),
    )
    num_cpu_blocks: int | None = Field(
        default=None, gt=0, le=MAX_CPU_BLOCKS, description="Size of the CPU tier in blocks (instead of cpu_bytes)."
    )
    policy: str = Field(
        default="return-time",
        description=(
            "CPU-tier eviction policy: 'return-time' (the default), 'lru', 'arc', or an import path "
            "'package.module:Class'."
        ),
    )
    model: str = Field(
        default="llama-3.1-8b",
        description=(f"A model preset ({', '.join(MODEL_PRESETS)}) or any model id (then give geometry)."),
    )
    model_revision: str = Field(default="", description="Model revision; part of the namespace.")
    geometry: GeometryConfig = Field(
        default_factory=lambda: GeometryConfig(),
        description="KV block layout; fields not given come from the model preset.",
    )
    shm_dir: str = Field(default="/dev/shm", min_length=1, description="Directory of the shared CPU region (a tmpfs).")
    region_name: str | None = Field(
        default=None,
        description="Name of the shared region file; default: derived from the process.",
    )
    tiers: list[dict[str, Any]] = Field(
        default_factory=list,
        description=(
            "Secondary tiers in cascade order, each {type: <tier type>|package.module:Class, **options}; "
            "options are validated by the tier (see the tier sections below)."
        ),
    )
    backpressure: BackpressureConfig = Field(
        default_factory=lambda: BackpressureConfig(),
        description=(
            "Skip cascades to a secondary tier whose store jobs got slow: {enabled, high_seconds, "
            "low_seconds, warmup_jobs, smoothing} (see the backpressure section below)."
        ),
    )
    shutdown_timeout: PositiveSeconds | None = Field(
        default=120.0,
        description=(
            "Seconds shutdown gives all secondary tiers together (above 0, finite, at most 1000000; 0 would "
            "abandon every tier at once); a tier that "
            "overruns its share is abandoned and counted as failed (the CPU tier stays mapped). null "
            "(in a file; 'none' as text): no deadline."
        ),
    )
    wait_timeout: WaitSeconds = Field(
        default=DEFAULT_WAIT_TIMEOUT,
        description=(
            "Seconds a request may wait on one block (a tier's RETRY, a write into the CPU tier: "
            "HIT_PENDING) before its lookup answers MISS and the engine recomputes it; a tier with a job "
            "in flight longer gets no lookups or cascades until it reports it (0.001 to 3600)."
        ),
    )
    failed_load_seconds: HoldSeconds = Field(
        default=DEFAULT_FAILED_LOAD_SECONDS,
        description=(
            "Seconds a tier is not believed about a block after its promise failed (its load failed or "
            "was refused, or its RETRY outlived wait_timeout): its HIT and RETRY count as MISS (1 to 86400)."
        ),
    )

    @field_validator("cpu_bytes", mode="before")
    @classmethod
    def _cpu_bytes(cls, value: Any) -> Any:
        if value is None:
            return None
        size = parse_size(value)
        if size <= 0:
            raise ValueError("cpu_bytes must be positive: give e.g. '4GiB'")
        return size

    @field_validator("num_cpu_blocks", mode="before")
    @classmethod
    def _num_cpu_blocks(cls, value: Any) -> Any:
        if isinstance(value, bool):  # here, not in the model's check, so the error names where it came from
            raise ValueError(f"num_cpu_blocks must be a number, not {str(value).lower()}")
        return value

    @field_validator("shutdown_timeout", mode="before")
    @classmethod
    def _no_deadline(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("none", "null"):
            return None
        return value

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        if ":" in value:
            module, _, name = value.partition(":")
            if not module or not name.isidentifier():
                raise ValueError(f"policy {value!r} must look like 'package.module:ClassName'")
            from kvtier.policies import resolve_policy

            try:
                resolve_policy(value)  # import it now: a module that fails to import is a config error
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
            return value
        known = _known_policies()
        if known is not None and value not in known:
            raise ValueError(f"policy {value!r} is unknown: use one of {known} or 'package.module:Class'")
        if known is None and not re.fullmatch(r"[a-z][a-z0-9_-]*", value):
            raise ValueError(
                f"policy {value!r} is not a policy name: use 'return-time', 'lru', 'arc' or 'package.module:Class'"
            )
        return value

    @field_validator("shm_dir")
    @classmethod
    def _shm_dir(cls, value: str) -> str:
        if not value.strip() or "\0" in value:  # refused when the config loads, not when the region is made
            raise ValueError(f"shm_dir {value!r:.60} names no directory: give a tmpfs directory such as /dev/shm")
        return value

    @field_validator("region_name")
    @classmethod
    def _region_name(cls, value: str | None) -> str | None:
        if value is not None:  # refused when the config loads, not when the region is made
            from kvtier.region import region_path

            try:
                region_path(value)
            except RegionError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("model must be a preset name or a model id, not empty")
        return value

    @field_validator("tiers", mode="before")
    @classmethod
    def _tiers(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, Mapping):
            value = [value]
        if not isinstance(value, list | tuple):
            raise ValueError(f"tiers must be a list of {{type: ..., ...}} mappings, got {type(value).__name__}")
        tiers = [_validate_tier(i, spec) for i, spec in enumerate(value)]
        _one_tier_per_root(tiers)
        return tiers

    @model_validator(mode="after")
    def _geometry_complete(self, info: ValidationInfo) -> KvtierConfig:
        if self.cpu_bytes is not None and self.num_cpu_blocks is not None:
            raise ValueError("cpu_bytes and num_cpu_blocks are both set: set only one of them")
        context = info.context or {}
        if not context.get("layout_from_engine"):
            try:
                self.kv_geometry()
            except ValueError as exc:
                sources = context.get("sources") or {}
                given = [f"{name} from {sources[name]}" for name in ("model", "geometry") if name in sources]
                where = f" ({', '.join(given)})" if given else ""
                raise ValueError(f"{exc}{where}") from None
        return self

    # ----------------------------------------------------------------- where values came from

    def record_sources(self, sources: Mapping[str, str]) -> None:
        """Remember where each field's value came from (the loader calls it once)."""
        self._sources = {k: v for k, v in sources.items() if k in type(self).model_fields}

    @property
    def sources(self) -> dict[str, str]:
        """Every field's source: ``"file kv.yaml"``, ``"environment variable KVTIER_X"``,
        ``"CLI flag --x"`` (or the caller's name for its values), or ``"default"``."""
        return {name: self._sources.get(name, "default") for name in type(self).model_fields}

    # ----------------------------------------------------------------- derived values

    @property
    def model_id(self) -> str:
        """The model id used in the namespace (a preset's id, or ``model`` itself)."""
        preset = find_preset(self.model)
        return str(preset["model_id"]) if preset else self.model

    def kv_geometry(self) -> KVGeometry:
        """The resolved :class:`KVGeometry` (preset values overridden by ``geometry``)."""
        preset = find_preset(self.model) or {}
        merged: dict[str, Any] = {"tokens_per_block": 16, "dtype": "bfloat16", "kv_factor": 2}
        merged.update({k: v for k, v in preset.items() if k != "model_id"})
        merged.update(self.geometry.model_dump(exclude_none=True))
        missing = [f for f in ("num_layers", "num_kv_heads", "head_dim") if f not in merged]
        if missing:
            raise ValueError(
                f"model {self.model!r} is not a preset ({', '.join(MODEL_PRESETS)}), "
                f"so geometry needs {', '.join(missing)}: "
                "e.g. geometry={num_layers: 32, num_kv_heads: 8, head_dim: 128}"
            )
        try:
            return KVGeometry(**merged)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    @property
    def block_bytes(self) -> int:
        return self.kv_geometry().bytes_per_block

    @property
    def row_stride(self) -> int:
        return row_stride_for(self.block_bytes)

    def resolved_num_cpu_blocks(self, block_bytes: int | None = None) -> int:
        """CPU-tier rows: ``num_cpu_blocks``, or ``cpu_bytes`` (default 4 GiB) / row stride.

        ``block_bytes`` (default: this config's geometry) is the payload of one row.
        Raises :class:`ConfigError` when not even one row fits.
        """
        if self.num_cpu_blocks is not None:
            return self.num_cpu_blocks
        size = self.cpu_bytes if self.cpu_bytes is not None else DEFAULT_CPU_BYTES
        rows = rows_that_fit(size, self.block_bytes if block_bytes is None else block_bytes)
        if rows > MAX_CPU_BLOCKS:  # refused here, naming the setting, not by the manager's build
            raise ConfigError(
                f"cpu_bytes={size} (from {self.sources.get('cpu_bytes', 'default')}) holds "
                f"{rows} blocks, above the CPU tier's limit of {MAX_CPU_BLOCKS} (2^32): give a smaller cpu_bytes"
            )
        return rows

    def namespace(self, *, tp_size: int = 1, tp_rank: int = 0, pp_size: int = 1, pp_rank: int = 0) -> Namespace:
        """The :class:`Namespace` of this configuration (one rank of the parallel layout)."""
        return Namespace(
            model_id=self.model_id,
            geometry=self.kv_geometry(),
            model_revision=self.model_revision,
            tp_size=tp_size,
            tp_rank=tp_rank,
            pp_size=pp_size,
            pp_rank=pp_rank,
        )
