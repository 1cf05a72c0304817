"""Secondary-tier registry: built-in tiers by name, out-of-tree tiers by import path.

Built-ins are imported lazily so optional dependencies (redis-py, obstore) are
needed only by the tiers that use them.
"""

from __future__ import annotations

from typing import Any

from kvtier.errors import ConfigError
from kvtier.plugins import load_class
from kvtier.tiers.base import SecondaryTier, TierContext

_BUILTIN: dict[str, str] = {
    "fs": "kvtier.tiers.fs:FilesystemTier",
    "redis": "kvtier.tiers.redis:RedisTier",
    "s3": "kvtier.tiers.s3:S3Tier",
    "memory": "kvtier.tiers.memory:MemoryTier",
}
_registered: dict[str, str] = {}


def register_tier(name: str, import_path: str) -> None:
    """Register ``"package.module:ClassName"`` under ``name`` (process-wide)."""
    if ":" not in import_path:
        raise ConfigError(f"tier import path {import_path!r} must look like 'package.module:ClassName'")
    _registered[name] = import_path


def builtin_tier_names() -> list[str]:
    """Names of the tiers that ship with kvtier, in documentation order."""
    return list(_BUILTIN)


def tier_names() -> list[str]:
    return sorted({**_BUILTIN, **_registered})


def resolve_tier_class(name_or_path: str) -> type[SecondaryTier]:
    """The tier class for a registered name or a ``module:Class`` path."""
    path = _registered.get(name_or_path) or _BUILTIN.get(name_or_path) or name_or_path
    if ":" not in path:
        raise ConfigError(
            f"unknown tier type {name_or_path!r}: use one of {tier_names()} "
            "or an import path 'package.module:ClassName'"
        )
    cls: type[SecondaryTier] = load_class(
        path, SecondaryTier, "tier", " Install the matching extra, e.g. pip install 'kvtier[redis]'"
    )
    return cls


def create_tier(spec: dict[str, Any], context: TierContext) -> SecondaryTier:
    """Build a tier from ``{"type": name_or_path, **options}``."""
    options = dict(spec)
    type_name = options.pop("type", None)
    if not isinstance(type_name, str) or not type_name:
        raise ConfigError(f"secondary tier #{context.index} needs a 'type' (one of {tier_names()})")
    cls = resolve_tier_class(type_name)
    try:
        return cls(context, **options)
    except TypeError as exc:
        raise ConfigError(f"secondary tier #{context.index} ({type_name}): bad options: {exc}") from exc
