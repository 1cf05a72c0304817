"""Secondary-tier registry: built-in tiers by name, out-of-tree tiers by import path.

One registry maps a tier type to its class, and the class carries its options
schema (``SecondaryTier.options_model``, a pydantic model). Everything that
takes a ``{"type": name_or_path, **options}`` spec goes through
:func:`validate_tier_options`: the configuration (so a typo in a tier option is
refused when the config is loaded, naming the option and the close match), the
manager (:func:`create_tier`) and the generated reference
(``docs/configuration.md``). Built-in names, names added by
:func:`register_tier` and ``package.module:Class`` paths are treated alike.

A class without an ``options_model`` has its options checked against its
constructor's keyword parameters instead. The cascade options every tier takes
(:class:`~kvtier.tiers.options.CascadeOptions`: ``admission``) are validated
here too and never reach the tier's constructor: :func:`create_tier` puts them
in its :class:`TierContext` for the manager.

Built-ins are imported lazily so optional dependencies (redis-py, obstore) are
needed only by the tiers that use them. The registry is process-wide;
:func:`register_tier` is meant for start-up, before tiers are built.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python

from kvtier.errors import ConfigError
from kvtier.plugins import load_class
from kvtier.tiers.base import SecondaryTier, TierContext
from kvtier.tiers.options import split_cascade_options
from kvtier.validation import did_you_mean, explain, shown_value

_BUILTIN: dict[str, str] = {
    "fs": "kvtier.tiers.fs:FilesystemTier",
    "redis": "kvtier.tiers.redis:RedisTier",
    "s3": "kvtier.tiers.s3:S3Tier",
    "memory": "kvtier.tiers.memory:MemoryTier",
}
_registered: dict[str, str] = {}

_SELECTOR_WORDS = frozenset({"all", "cpu", "primary", "local", "remote"})
"""Words the per-request tier selectors give a meaning of their own (``kvtier.request_control``):
a tier type spelled so could never be selected by its name."""


def register_tier(name: str, import_path: str) -> None:
    """Register ``"package.module:ClassName"`` under ``name`` (process-wide): a config's ``type``
    may then say ``name``. A non-empty string without ``:`` or whitespace, not a built-in type (a
    plugin never replaces ``fs``, ``redis``...) and not a word of the per-request tier selectors
    (``all``, ``cpu``, ``primary``, ``local``, ``remote``). Labels (``"<n>:<tier_type>"``) and
    selectors name a tier by its class's ``tier_type``: give the class ``tier_type = name``."""
    if not isinstance(name, str) or not name or ":" in name or any(c.isspace() for c in name):
        raise ConfigError(f"tier type name {name!r} must be a non-empty string without ':' or whitespace")
    if name in _BUILTIN:
        raise ConfigError(f"tier type {name!r} is a built-in tier of kvtier: register yours under another name")
    if name.lower() in _SELECTOR_WORDS:
        raise ConfigError(
            f"tier type {name!r} is a word of the per-request tier selectors ({', '.join(sorted(_SELECTOR_WORDS))}): "
            "register yours under another name"
        )
    if not isinstance(import_path, str) or ":" not in import_path:
        raise ConfigError(f"tier import path {import_path!r} must look like 'package.module:ClassName'")
    _registered[name] = import_path


def tier_names() -> list[str]:
    """Every tier type known by name: the built-ins and those added by :func:`register_tier`."""
    return sorted({**_BUILTIN, **_registered})


def builtin_tier_names() -> list[str]:
    """The tier types that ship with kvtier, in documentation order."""
    return list(_BUILTIN)


def resolve_tier_class(name_or_path: str) -> type[SecondaryTier]:
    """The tier class for a registered name or a ``module:Class`` path.

    Raises :class:`ConfigError` for an unknown name, a module that fails to
    import (naming the extra to install for a built-in) or a class that is not
    a :class:`SecondaryTier`.
    """
    path = _registered.get(name_or_path) or _BUILTIN.get(name_or_path) or name_or_path
    if ":" not in path:
        raise ConfigError(
            f"unknown tier type {shown_value(name_or_path)}: use one of {tier_names()} "
            "or an import path 'package.module:ClassName'"
        )
    hint = f" Install what it needs: pip install 'kvtier[{name_or_path}]'." if name_or_path in _BUILTIN else ""
    cls: type[SecondaryTier] = load_class(path, SecondaryTier, "tier", hint)
    return cls


def _tier_type(spec: Any, where: str) -> str:
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where} must be a mapping like {{'type': 'fs', 'root': '/path'}}, got {shown_value(spec)}")
    tier_type = spec.get("type")
    if not isinstance(tier_type, str) or not tier_type:
        raise ConfigError(
            f"{where} needs a 'type': one of {tier_names()} or an import path 'package.module:ClassName'"
        )
    if ":" not in tier_type and tier_type not in _BUILTIN and tier_type not in _registered:
        shown = shown_value(tier_type)
        raise ConfigError(
            f"{where}.type {shown}: unknown tier type {shown}: use one of {tier_names()} "
            "or an import path 'package.module:ClassName'"
        )
    return tier_type


def _check_signature(cls: type[SecondaryTier], options: Mapping[str, Any], what: str) -> None:
    """For a tier without an options model: the options must match its constructor's keywords."""
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name not in ("self", "context")]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(
            f"{what} has bad options: unknown option(s) {did_you_mean(unknown, accepted)}: "
            f"known options are {sorted(accepted)}"
        )
    missing = [p.name for p in params if p.default is p.empty and p.name in accepted and p.name not in options]
    if missing:
        raise ConfigError(f"{what} has bad options: missing required option(s) {missing}")


def validate_tier_options(spec: Any, *, where: str = "tier") -> dict[str, Any]:
    """Validate a ``{"type": name_or_path, **options}`` spec; returns the options for the constructor.

    The options (``spec`` without ``type``) are validated by the tier class's
    ``options_model``: the result holds the options that were given, converted
    by the model (e.g. ``"64GiB"`` -> bytes), and is passed as keyword arguments
    to the class after its :class:`TierContext`; options left out keep the
    constructor's defaults. Without a model, the options are checked against the
    constructor's signature and returned unchanged.

    ``where`` starts every error message (``"tiers[0]"``, ``"secondary tier #1"``).
    Raises :class:`ConfigError` naming the option, the bad value and the fix.
    Imports the tier's module (and so runs it) if it is not yet imported.
    """
    tier_type = _tier_type(spec, where)
    try:
        cls = resolve_tier_class(tier_type)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    what = f"{where} ({tier_type})"
    options, cascade = split_cascade_options({k: v for k, v in spec.items() if k != "type"}, what)
    given = cascade.model_dump(exclude_unset=True)
    model = getattr(cls, "options_model", None)
    if model is None:
        _check_signature(cls, options, what)
        return {**options, **given}
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise ConfigError(f"{what}: {cls.__qualname__}.options_model must be a pydantic BaseModel subclass")
    try:
        validated = model.model_validate(options)
    except ValidationError as exc:
        raise ConfigError(f"{what} has bad options: " + explain(exc, model, prefix="option")) from None
    return {**validated.model_dump(exclude_unset=True), **given}


def shown_tier_options(spec: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` (valid) as JSON-able values for display: ``{"type": ..., **options given}``,
    through the tier's options model, so secrets stay hidden (a ``SecretStr`` as
    ``'**********'``, a password in a URL as ``***``)."""
    options, cascade = split_cascade_options({k: v for k, v in spec.items() if k != "type"}, str(spec["type"]))
    model = getattr(resolve_tier_class(spec["type"]), "options_model", None)
    if isinstance(model, type) and issubclass(model, BaseModel):
        shown = model.model_validate(options).model_dump(mode="json", exclude_unset=True)
    else:
        shown = to_jsonable_python(options)
    return {"type": spec["type"], **shown, **cascade.model_dump(exclude_unset=True)}


def create_tier(spec: Mapping[str, Any], context: TierContext) -> SecondaryTier:
    """Build a tier from ``{"type": name_or_path, **options}`` (validated by :func:`validate_tier_options`)."""
    where = f"secondary tier #{context.index}"
    options, cascade = split_cascade_options(validate_tier_options(spec, where=where), where)
    context.admission = cascade.admission
    cls = resolve_tier_class(spec["type"])
    try:
        return cls(context, **options)
    except TypeError as exc:
        raise ConfigError(f"{where} ({spec['type']}): bad options: {exc}") from exc
