"""One configuration schema for the whole stack, and its loaders.

The same field names are used everywhere:

* files (YAML ``.yaml``/``.yml``, TOML ``.toml``, JSON ``.json``), either at the
  top level or under a single ``kvtier`` table/section;
* environment variables ``KVTIER_<FIELD>`` (upper case; nested values such as
  ``tiers`` and ``geometry`` are JSON);
* CLI flags ``--<field-with-dashes>`` (nested values as JSON).

Precedence is file < environment < CLI, field by field. ``geometry`` is merged
key by key across sources (an env var can override just ``tokens_per_block``);
``tiers`` is replaced as a whole. ``cpu_bytes`` and ``num_cpu_blocks`` are one
setting: the highest-precedence source that names either one wins.

Every validation problem raises :class:`~kvtier.errors.ConfigError` whose message
names the field, where its value came from, and the fix.

All functions here are pure (no global state) and may be called from any thread.
"""

from __future__ import annotations

import difflib
import inspect
import json
import logging
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import to_jsonable_python

from kvtier.errors import ConfigError
from kvtier.keys import KVGeometry, Namespace, dtype_bytes
from kvtier.region import format_bytes, round_up

if TYPE_CHECKING:
    from kvtier.manager import TieringManager  # type: ignore[import-not-found,unused-ignore]

logger = logging.getLogger(__name__)

ENV_PREFIX = "KVTIER_"
DEFAULT_CPU_BYTES = 4 * 1024**3

# --------------------------------------------------------------------------- sizes

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a size string.

    ``"4GiB"``, ``"4G"`` and ``"4 gib"`` are 4 * 2**30; ``"4GB"`` is 4 * 10**9;
    ``"512MiB"``, ``"1.5GiB"`` and ``"4096"`` work too. Raises :class:`ConfigError`
    (naming the value and the accepted forms) for anything else or a negative size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"size {value!r} is a boolean: give bytes as an integer or a string like '4GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"size {value} is negative: give a positive number of bytes")
        return value
    if isinstance(value, float):
        if value < 0 or not value.is_integer():
            raise ConfigError(f"size {value} must be a whole, non-negative number of bytes")
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            unit = m.group(2).lower()
            if unit in _SIZE_UNITS:
                return int(float(m.group(1)) * _SIZE_UNITS[unit])
        raise ConfigError(
            f"size {value!r} is not understood: use bytes (e.g. 4294967296) or a number "
            "with a unit "
            "such as '512MiB', '4GiB', '4G' (binary) or '4GB' (decimal)"
        )
    raise ConfigError(f"size {value!r} has type {type(value).__name__}: use an int or a string like '4GiB'")


def format_size(num_bytes: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units, at most one decimal."""
    return format_bytes(num_bytes)


def row_stride_for(block_bytes: int) -> int:
    """Bytes one CPU row takes in the shared region: the block rounded up to a page."""
    return round_up(block_bytes)


# --------------------------------------------------------------------------- model presets

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "model_id": "meta-llama/Llama-3.1-8B-Instruct",
        "num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
    },
    "llama-3.1-70b": {
        "model_id": "meta-llama/Llama-3.1-70B-Instruct",
        "num_layers": 80, "num_kv_heads": 8, "head_dim": 128,
    },
    "llama-3.2-1b": {
        "model_id": "meta-llama/Llama-3.2-1B-Instruct",
        "num_layers": 16, "num_kv_heads": 8, "head_dim": 64,
    },
    "qwen2.5-7b": {
        "model_id": "Qwen/Qwen2.5-7B-Instruct",
        "num_layers": 28, "num_kv_heads": 4, "head_dim": 128,
    },
    "qwen2.5-0.5b": {
        "model_id": "Qwen/Qwen2.5-0.5B-Instruct",
        "num_layers": 24, "num_kv_heads": 2, "head_dim": 64,
    },
    "mistral-7b": {
        "model_id": "mistralai/Mistral-7B-Instruct-v0.3",
        "num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
    },
    "deepseek-v3": {
        "model_id": "deepseek-ai/DeepSeek-V3",
        "num_layers": 61, "num_kv_heads": 1, "head_dim": 576, "kv_factor": 1,
    },
    "opt-125m": {
        "model_id": "facebook/opt-125m",
        "num_layers": 12, "num_kv_heads": 12, "head_dim": 64,
    },
    "tiny": {
        "model_id": "kvtier/tiny",
        "num_layers": 2, "num_kv_heads": 2, "head_dim": 64,
    },
}  # fmt: skip
"""Known model layouts by preset name. Unknown model ids need an explicit ``geometry``."""


def find_preset(model: str) -> dict[str, Any] | None:
    """The preset for a preset name or the model id it stands for (case-insensitive)."""
    lowered = model.lower()
    for name, preset in MODEL_PRESETS.items():
        if lowered in (name, str(preset["model_id"]).lower()):
            return preset
    return None


# --------------------------------------------------------------------------- schema


class GeometryConfig(BaseModel):
    """KV block layout; any field left out is taken from the ``model`` preset."""

    model_config = ConfigDict(extra="forbid")

    num_layers: int | None = Field(default=None, gt=0, description="Attention layers held by this rank.")
    num_kv_heads: int | None = Field(default=None, gt=0, description="KV heads per layer held by this rank.")
    head_dim: int | None = Field(default=None, gt=0, description="Elements per head (per token).")
    tokens_per_block: int | None = Field(
        default=None, gt=0, description="Tokens per KV block (the engine's block size). Default 16."
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


class FsTierConfig(BaseModel):
    """Local disk / NVMe tier (``type: fs``)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["fs"] = "fs"
    root: str = Field(description="Directory that holds the tier's files (created if missing).")
    max_bytes: int | None = Field(
        default=None, description="Byte capacity (LRU of files beyond it). Sizes like '64GiB'."
    )
    read_threads: int | None = Field(default=None, gt=0, description="I/O threads serving promotions.")
    write_threads: int | None = Field(default=None, gt=0, description="I/O threads serving cascades.")
    fsync: bool | None = Field(default=None, description="fsync every file before it becomes visible.")
    direct_io: bool | Literal["auto"] | None = Field(
        default=None, description="Use O_DIRECT where the file system allows it."
    )

    @field_validator("max_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return None if value is None else parse_size(value)


class RedisTierConfig(BaseModel):
    """Redis / Valkey tier (``type: redis``), standalone or cluster."""

    model_config = ConfigDict(extra="allow")

    type: Literal["redis"] = "redis"
    url: str = Field(description="redis://[user:pass@]host:port[/db] or rediss:// for TLS.")
    cluster: bool | None = Field(default=None, description="Talk to a Redis Cluster.")
    prefix: str | None = Field(default=None, description="Key prefix in front of the namespace digest.")
    ttl_seconds: float | None = Field(default=None, gt=0, description="Expire values after this many seconds.")

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not re.match(r"^(redis|rediss|unix)://", value):
            raise ValueError(f"url {value!r} must start with redis://, rediss:// (TLS) or unix://")
        return value


_TIER_SCHEMAS: dict[str, type[BaseModel]] = {"fs": FsTierConfig, "redis": RedisTierConfig}


def _validate_tier(index: int, spec: Any) -> dict[str, Any]:
    """Validate one ``{"type": ..., **options}`` entry; returns it normalized."""
    where = f"tiers[{index}]"
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where} must be a mapping like {{'type': 'fs', 'root': '/path'}}, got {spec!r}")
    tier_type = spec.get("type")
    if not isinstance(tier_type, str) or not tier_type:
        raise ValueError(f"{where} needs a 'type': 'fs', 'redis', or an import path 'package.module:Class'")
    schema = _TIER_SCHEMAS.get(tier_type)
    if schema is None:
        declared = _declared_options_model(tier_type)
        if declared is not None:
            options = {k: v for k, v in spec.items() if k != "type"}
            try:
                model = declared.model_validate(options)
            except ValidationError as exc:
                raise ValueError(f"{where} ({tier_type}): " + _explain(exc, prefix="")) from None
            return {"type": tier_type, **model.model_dump(exclude_unset=True)}
        if ":" not in tier_type:
            from kvtier.tiers.registry import tier_names

            raise ValueError(
                f"{where}.type {tier_type!r} is unknown: use one of {tier_names()} "
                "or an import path 'package.module:Class'"
            )
        return dict(spec)
    try:
        model = schema.model_validate(dict(spec))
    except ValidationError as exc:
        raise ValueError(f"{where} ({tier_type}): " + _explain(exc, prefix="")) from None
    out = {k: v for k, v in model.model_dump().items() if v is not None}
    given = set(out) - {"type"}
    if given:
        allowed = _tier_option_names(tier_type)
        if allowed is not None:
            unknown = sorted(given - allowed)
            if unknown:
                known = sorted(allowed)
                hints = [difflib.get_close_matches(u, known, n=1) for u in unknown]
                fix = "; ".join(
                    f"{u!r} (did you mean {h[0]!r}?)" if h else repr(u) for u, h in zip(unknown, hints, strict=True)
                )
                raise ValueError(f"{where} ({tier_type}) has unknown option(s) {fix}: known options are {known}")
    return out


def _declared_options_model(tier_type: str) -> type[BaseModel] | None:
    """The ``options_model`` a registered tier class declares (None if it declares none)."""
    from kvtier.tiers.registry import resolve_tier_class, tier_names

    if tier_type in tier_names():
        return resolve_tier_class(tier_type).options_model
    if ":" not in tier_type:
        return None
    try:  # an import path that does not import here is checked when the tier is built
        return resolve_tier_class(tier_type).options_model
    except ConfigError:
        return None


def _tier_option_names(tier_type: str) -> set[str] | None:
    """Keyword options the tier class accepts, or None when unknown (class not importable)."""
    try:
        from kvtier.tiers.registry import resolve_tier_class

        cls = resolve_tier_class(tier_type)
    except (ConfigError, ImportError):
        return None
    params = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.name not in ("self", "context")}


def _known_policies() -> list[str] | None:
    try:
        from kvtier.policies import POLICIES
    except ImportError:
        return None
    return sorted(POLICIES)


class KvtierConfig(BaseModel):
    """The whole kvtier configuration. See ``docs/configuration.md`` for every field."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    cpu_bytes: int | None = Field(
        default=None,
        description=(
            "Size of the CPU tier in /dev/shm, in bytes or as '4GiB'/'512MiB'. "
            "Default 4GiB when num_cpu_blocks is not set either."
        ),
    )
    num_cpu_blocks: int | None = Field(
        default=None, gt=0, description="Size of the CPU tier in blocks (instead of cpu_bytes)."
    )
    policy: str = Field(
        default="lru",
        description=("CPU-tier eviction policy: 'lru', 'arc', or an import path 'package.module:Class'."),
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
    shm_dir: str = Field(default="/dev/shm", description="Directory of the shared CPU region (a tmpfs).")
    region_name: str | None = Field(
        default=None,
        description="Name of the shared region file; default: derived from the process.",
    )
    tiers: list[dict[str, Any]] = Field(
        default_factory=list,
        description=("Secondary tiers in cascade order, each {type: fs|redis|package.module:Class, **options}."),
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

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        if ":" in value:
            module, _, name = value.partition(":")
            if not module or not name.isidentifier():
                raise ValueError(f"policy {value!r} must look like 'package.module:ClassName'")
            return value
        known = _known_policies()
        if known is not None and value not in known:
            raise ValueError(f"policy {value!r} is unknown: use one of {known} or 'package.module:Class'")
        if known is None and not re.fullmatch(r"[a-z][a-z0-9_-]*", value):
            raise ValueError(f"policy {value!r} is not a policy name: use 'lru', 'arc' or 'package.module:Class'")
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
        return [_validate_tier(i, spec) for i, spec in enumerate(value)]

    @model_validator(mode="after")
    def _geometry_complete(self) -> KvtierConfig:
        if self.cpu_bytes is not None and self.num_cpu_blocks is not None:
            raise ValueError("cpu_bytes and num_cpu_blocks are both set: set only one of them")
        self.kv_geometry()  # raises a ValueError naming the missing fields
        return self

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

    def resolved_num_cpu_blocks(self) -> int:
        """CPU-tier rows: ``num_cpu_blocks``, or ``cpu_bytes`` (default 4 GiB) / row stride."""
        if self.num_cpu_blocks is not None:
            return self.num_cpu_blocks
        size = self.cpu_bytes if self.cpu_bytes is not None else DEFAULT_CPU_BYTES
        blocks = size // self.row_stride
        if blocks <= 0:
            raise ConfigError(
                f"cpu_bytes={size} holds no block of {self.row_stride} bytes (one row): "
                f"raise cpu_bytes to at least {self.row_stride}"
            )
        return blocks

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


# --------------------------------------------------------------------------- loaders

_FIELDS = tuple(KvtierConfig.model_fields)
_JSON_FIELDS = {"tiers", "geometry"}
_CPU_SIZE_FIELDS = ("cpu_bytes", "num_cpu_blocks")


def env_var(field: str) -> str:
    """``cpu_bytes`` -> ``KVTIER_CPU_BYTES``."""
    return ENV_PREFIX + field.upper()


def cli_flag(field: str) -> str:
    """``cpu_bytes`` -> ``--cpu-bytes``."""
    return "--" + field.replace("_", "-")


def _read_file(path: str) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {path!r} cannot be read: {exc.strerror or exc}") from None
    suffix = p.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - exercised on 3.10 only
                import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(
                f"config file {path!r} has an unknown extension {suffix!r}: use .yaml, .yml, .toml or .json"
            )
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"config file {path!r} is not valid {suffix.lstrip('.').upper()}: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of fields, got {type(data).__name__}")
    if set(data) == {"kvtier"} and isinstance(data["kvtier"], dict):
        data = data["kvtier"]
    return dict(data)


def _parse_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        field = name[len(ENV_PREFIX) :].lower()
        if field not in _FIELDS:
            close = difflib.get_close_matches(field, _FIELDS, n=1)
            if close:
                logger.warning("ignoring %s: not a kvtier setting (did you mean %s?)", name, env_var(close[0]))
            continue
        out[field] = _decode_text(field, raw, source=f"environment variable {name}")
    return out


def _decode_text(field: str, raw: Any, *, source: str) -> Any:
    """Strings from env vars and CLI flags: JSON for nested fields, '' means unset."""
    if not isinstance(raw, str):
        return raw
    if field in _JSON_FIELDS:
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            example = '[{"type": "fs", "root": "/mnt/nvme/kv"}]' if field == "tiers" else '{"tokens_per_block": 16}'
            raise ConfigError(
                f"{field} from {source} is not valid JSON ({exc.msg}): write it as JSON, e.g. {example}"
            ) from None
    if field in ("region_name", "cpu_bytes", "num_cpu_blocks") and raw.strip() == "":
        return None
    return raw


def _merge(layers: list[tuple[str, dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, str]]:
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, data in layers:
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            hints = [difflib.get_close_matches(u, _FIELDS, n=1) for u in unknown]
            text = ", ".join(
                f"{u!r} (did you mean {h[0]!r}?)" if h else repr(u) for u, h in zip(unknown, hints, strict=True)
            )
            raise ConfigError(f"unknown setting(s) {text} in {source}: known settings are {list(_FIELDS)}")
        present = [f for f in _CPU_SIZE_FIELDS if data.get(f) is not None]
        if len(present) == 2:
            raise ConfigError(f"cpu_bytes and num_cpu_blocks are both set in {source}: set only one of them")
        if present:
            for f in _CPU_SIZE_FIELDS:
                merged.pop(f, None)
                sources.pop(f, None)
        for field, value in data.items():
            if value is None:
                continue
            if field == "geometry" and isinstance(value, Mapping) and isinstance(merged.get("geometry"), dict):
                merged["geometry"] = {**merged["geometry"], **value}
            else:
                merged[field] = dict(value) if isinstance(value, Mapping) else value
            sources[field] = source
    return merged, sources


def _explain(exc: ValidationError, prefix: str = "config", sources: Mapping[str, str] | None = None) -> str:
    """One readable line per pydantic error: the field, where it came from, what to do."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        top = str(err["loc"][0]) if err["loc"] else ""
        where = f" (from {sources[top]})" if sources and top in sources else ""
        if err["type"] == "extra_forbidden":
            known = ""
            if len(err["loc"]) == 2 and err["loc"][0] == "geometry":
                known = f": known geometry fields are {list(GeometryConfig.model_fields)}"
            msg = f"is not a setting{known}"
        elif "input" in err and err["type"] not in ("value_error", "assertion_error"):
            msg = f"{msg} (got {err['input']!r})"
        name = f"{prefix} field {loc!r}" if prefix and loc else (loc or prefix or "config")
        lines.append(f"{name}{where}: {msg}")
    return "; ".join(lines)


def load_config(
    file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
) -> KvtierConfig:
    """Resolve the configuration from a file, environment variables and CLI values.

    ``env`` defaults to ``os.environ`` (pass ``{}`` to ignore the environment).
    ``cli`` maps field names (underscores) to values; ``None`` values mean "not
    given". Strings for ``tiers``/``geometry`` in env and CLI are parsed as JSON.
    Raises :class:`ConfigError` naming the field, its source and the fix.
    """
    layers: list[tuple[str, dict[str, Any]]] = []
    if file is not None:
        layers.append((f"file {os.fspath(file)}", _read_file(os.fspath(file))))
    layers.append(("environment", _parse_env(os.environ if env is None else env)))
    if cli:
        cli_values: dict[str, Any] = {}
        for name, value in cli.items():
            field = name.replace("-", "_")
            cli_values[field] = _decode_text(field, value, source=f"CLI flag {cli_flag(field)}")
        layers.append(("CLI flags", cli_values))
    merged, sources = _merge(layers)
    try:
        return KvtierConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, sources=sources)) from None
    except ConfigError as exc:  # raised inside a validator that pydantic let through
        raise ConfigError(str(exc)) from None


def build_manager(
    config: KvtierConfig,
    *,
    expected_mappers: int = 1,
    namespace: Namespace | None = None,
    **overrides: Any,
) -> TieringManager:
    """Create the :class:`~kvtier.manager.TieringManager` that ``config`` describes.

    Called once by the process that owns the scheduler. ``namespace`` overrides
    ``config.namespace()`` (an engine adds its parallel layout); ``overrides``
    are passed on to ``TieringManager.create``. Blocks while the region is created
    and pre-faulted (about 0.9 s per GiB).
    """
    from kvtier.manager import TieringManager

    kwargs: dict[str, Any] = {
        "namespace": namespace if namespace is not None else config.namespace(),
        "policy": config.policy,
        "tiers": [dict(t) for t in config.tiers],
        "region_name": config.region_name,
        "shm_dir": config.shm_dir,
        "expected_mappers": expected_mappers,
    }
    if config.num_cpu_blocks is not None:
        kwargs["num_cpu_blocks"] = config.num_cpu_blocks
    else:
        kwargs["num_cpu_blocks"] = config.resolved_num_cpu_blocks()
    kwargs.update(overrides)
    return TieringManager.create(**kwargs)


def _tier_capacity(spec: Mapping[str, Any], block_bytes: int) -> dict[str, Any]:
    from kvtier.tiers.format import HEADER_SIZE

    out: dict[str, Any] = {"type": spec.get("type")}
    # JSON-able, with secrets (pydantic SecretStr) shown as '**********'
    out["options"] = to_jsonable_python({k: v for k, v in spec.items() if k != "type"})
    max_bytes = spec.get("max_bytes")
    if isinstance(max_bytes, int):
        per_block = row_stride_for(block_bytes + HEADER_SIZE)
        if spec.get("type") == "fs":
            from kvtier.tiers.fs_layout import entry_bytes

            per_block = entry_bytes(block_bytes)
        out["capacity_bytes"] = max_bytes
        out["capacity"] = format_size(max_bytes)
        out["blocks"] = max_bytes // per_block
        out["bytes_per_stored_block"] = per_block
    else:
        out["capacity_bytes"] = None
        out["blocks"] = None
    return out


def describe_config(config: KvtierConfig) -> dict[str, Any]:
    """The resolved configuration plus derived sizes, JSON-able (``kvtier config show``)."""
    geometry = config.kv_geometry()
    ns = config.namespace()
    blocks = config.resolved_num_cpu_blocks()
    stride = config.row_stride
    return {
        "config": config.model_dump(mode="json"),
        "model_id": config.model_id,
        "namespace": ns.hexdigest,
        "geometry": {
            "num_layers": geometry.num_layers,
            "num_kv_heads": geometry.num_kv_heads,
            "head_dim": geometry.head_dim,
            "tokens_per_block": geometry.tokens_per_block,
            "dtype": geometry.dtype,
            "kv_factor": geometry.kv_factor,
        },
        "bytes_per_token": geometry.bytes_per_token,
        "bytes_per_block": geometry.bytes_per_block,
        "block_size": format_size(geometry.bytes_per_block),
        "row_stride": stride,
        "cpu": {
            "blocks": blocks,
            "tokens": blocks * geometry.tokens_per_block,
            "region_bytes": blocks * stride,
            "region_size": format_size(blocks * stride),
            "shm_dir": config.shm_dir,
            "policy": config.policy,
        },
        "tiers": [_tier_capacity(t, geometry.bytes_per_block) for t in config.tiers],
    }


# --------------------------------------------------------------------------- reference docs


def _type_text(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "")
    return _cell(re.sub(r"<class '([^']+)'>", r"\1", text).replace("kvtier.config.", ""))


def _cell(text: object) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|")


def _documented_tier_schemas() -> dict[str, type[BaseModel]]:
    """Options models of the built-in tiers: the ones declared by tier classes, then config's own."""
    from kvtier.tiers.registry import builtin_tier_names, resolve_tier_class

    schemas: dict[str, type[BaseModel]] = dict(_TIER_SCHEMAS)
    for name in builtin_tier_names():
        if name not in schemas:
            try:
                model = resolve_tier_class(name).options_model
            except ConfigError:  # not importable here: documented where it is
                continue
            if model is not None:
                schemas[name] = model
    return schemas


def render_config_reference() -> str:
    """The Markdown of ``docs/configuration.md``, generated from the schema."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from kvtier/config.py by `kvtier config reference`;",
        "     tests/test_config.py keeps it in step. -->",
        "",
        "kvtier reads one configuration from, in increasing precedence: a file (YAML, TOML",
        "or JSON, fields at the top level or under a `kvtier` section), environment",
        "variables `KVTIER_<FIELD>`, and CLI flags `--<field-with-dashes>`. Nested values",
        "(`geometry`, `tiers`) are JSON in environment variables and flags. `geometry` is",
        "merged key by key across sources; `tiers` is replaced as a whole; `cpu_bytes` and",
        "`num_cpu_blocks` are one setting (the highest-precedence source wins).",
        "",
        "Sizes accept bytes or units: `512MiB`, `4GiB`, `4G` (binary), `4GB` (decimal).",
        "",
        "## Top-level fields",
        "",
        "| field | env var | CLI flag | type | default | meaning |",
        "|---|---|---|---|---|---|",
    ]

    def default_text(info: Any) -> str:
        if info.default_factory is not None:
            value = info.default_factory()
            return "`[]`" if value == [] else "(from preset)"
        return f"`{info.default!r}`" if info.default is not None else "-"

    for name, info in KvtierConfig.model_fields.items():
        lines.append(
            f"| `{name}` | `{env_var(name)}` | `{cli_flag(name)}` | "
            f"{_type_text(info.annotation)} | "
            f"{default_text(info)} | {_cell(info.description)} |"
        )
    lines += ["", "## `geometry`", "", "| field | type | meaning |", "|---|---|---|"]
    for name, info in GeometryConfig.model_fields.items():
        lines.append(f"| `{name}` | {_type_text(info.annotation)} | {_cell(info.description)} |")
    lines += [
        "",
        "## Model presets",
        "",
        "| preset | model id | layers | KV heads | head dim | kv_factor |",
    ]
    lines.append("|---|---|---|---|---|---|")
    for name, p in MODEL_PRESETS.items():
        lines.append(
            f"| `{name}` | `{p['model_id']}` | {p['num_layers']} | {p['num_kv_heads']} | "
            f"{p['head_dim']} | {p.get('kv_factor', 2)} |"
        )
    for tier_type, schema in _documented_tier_schemas().items():
        lines += ["", f"## Tier `{tier_type}`", "", str(schema.__doc__ or "").strip(), ""]
        lines += ["| option | type | meaning |", "|---|---|---|"]
        for name, info in schema.model_fields.items():
            if name == "type":
                continue
            required = " (required)" if info.is_required() else ""
            lines.append(f"| `{name}`{required} | {_type_text(info.annotation)} | {_cell(info.description)} |")
    lines += [
        "",
        "Other options are passed to the tier class as keyword arguments and checked against its",
        "constructor. Out-of-tree tiers use `type: package.module:ClassName`.",
        "",
        "## Example",
        "",
        "```yaml",
        "cpu_bytes: 8GiB",
        "policy: lru",
        "model: llama-3.1-8b",
        "geometry:",
        "  tokens_per_block: 16",
        "tiers:",
        "  - type: fs",
        "    root: /mnt/nvme/kvtier",
        "    max_bytes: 200GiB",
        "  - type: redis",
        "    url: redis://cache.internal:6379/0",
        "    ttl_seconds: 3600",
        "```",
        "",
    ]
    return "\n".join(lines)
