"""From a configuration to a running manager, and the sizes it implies.

:func:`build_manager` is called once by the process that owns the scheduler;
:func:`describe_config` is pure (``kvtier config show``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtier.config.schema import KvtierConfig
from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.units import format_size

if TYPE_CHECKING:
    from kvtier.manager import TieringManager


def _check_config(config: Any, caller: str) -> None:
    """A :class:`KvtierConfig`, or a ConfigError saying how to make one (a dict of settings is not one)."""
    if not isinstance(config, KvtierConfig):
        raise ConfigError(
            f"{caller} takes a KvtierConfig, got a {type(config).__name__}: make one with "
            "kvtier.config.load_config(...), e.g. load_config(cli={'model': 'tiny'}) for settings in a dict"
        )


def build_manager(
    config: KvtierConfig,
    *,
    expected_mappers: int = 1,
    namespace: Namespace | None = None,
    block_bytes: int | None = None,
    **overrides: Any,
) -> TieringManager:
    """Create the :class:`~kvtier.manager.TieringManager` that ``config`` describes.

    Called once by the process that owns the scheduler. ``namespace`` overrides
    ``config.namespace()`` (an engine adds its parallel layout); ``block_bytes``
    overrides the block size of the config's geometry (an engine whose rows are
    opaque bytes passes its own); ``overrides`` are passed on to
    ``TieringManager.create``. Blocks while the region is created and
    pre-faulted (about 0.9 s per GiB).
    """
    from kvtier.manager import TieringManager

    _check_config(config, "build_manager")
    if block_bytes is None:
        block_bytes = config.block_bytes
    kwargs: dict[str, Any] = {
        "namespace": namespace if namespace is not None else config.namespace(),
        "block_bytes": block_bytes,
        "num_cpu_blocks": config.resolved_num_cpu_blocks(block_bytes),
        "policy": config.policy,
        "tiers": [dict(t) for t in config.tiers],
        "region_name": config.region_name,
        "shm_dir": config.shm_dir,
        "expected_mappers": expected_mappers,
        "shutdown_timeout": config.shutdown_timeout,
        "wait_timeout": config.wait_timeout,
        "failed_load_seconds": config.failed_load_seconds,
        "backpressure": config.backpressure.settings(),
    }
    kwargs.update(overrides)
    return TieringManager.create(**kwargs)


def _tier_capacity(spec: Mapping[str, Any], block_bytes: int) -> dict[str, Any]:
    """What a tier spec gives: its options (secrets hidden) and, where its options set a byte
    capacity, how many blocks fit (the tier class says what a stored block costs)."""
    from kvtier.tiers.options import CASCADE_OPTIONS
    from kvtier.tiers.registry import resolve_tier_class, shown_tier_options

    cls = resolve_tier_class(spec["type"])
    shown = shown_tier_options(spec)
    out: dict[str, Any] = {"type": spec["type"], "options": {k: v for k, v in shown.items() if k != "type"}}
    capacity = cls.capacity_bytes({k: v for k, v in spec.items() if k != "type" and k not in CASCADE_OPTIONS})
    if capacity is None:
        out["capacity_bytes"] = None
        out["blocks"] = None
        return out
    per_block = cls.bytes_per_block(block_bytes)
    out["capacity_bytes"] = capacity
    out["capacity"] = format_size(capacity)
    out["blocks"] = capacity // per_block
    out["bytes_per_stored_block"] = per_block
    return out


def describe_config(config: KvtierConfig) -> dict[str, Any]:
    """The resolved configuration plus derived sizes, JSON-able (``kvtier config show``)."""
    _check_config(config, "describe_config")
    geometry = config.kv_geometry()
    ns = config.namespace()
    blocks = config.resolved_num_cpu_blocks()
    stride = config.row_stride
    from kvtier.tiers.registry import shown_tier_options

    return {
        "config": {**config.model_dump(mode="json"), "tiers": [shown_tier_options(t) for t in config.tiers]},
        "sources": config.sources,
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
