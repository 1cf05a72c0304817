"""Tier options: the base of every tier's options model, its bounded number types, and how a
constructor takes its options.

A tier declares its options once, as a pydantic model (``SecondaryTier.options_model``)
whose fields carry their type, default, bounds and ``description`` (the generated
``docs/configuration.md`` shows them); the registry validates config specs through it.
A tier's constructor takes that model, as an instance or as keyword arguments
(:func:`tier_options`), so the model is the one place that holds names, types,
defaults and bounds, whether the tier is built from a config file or from Python::

    FilesystemTier(context, root="/nvme/kv", max_bytes="64GiB")
    FilesystemTier(context, FilesystemTierOptions(root="/nvme/kv", max_bytes="64GiB"))

Numbers are finite and bounded: ``inf``, ``nan``, ``1e400`` or a 400-digit size are
refused with a :class:`~kvtier.errors.ConfigError` naming the option, never an
``OverflowError`` later (a timeout of 1e300 s would overflow ``threading``'s waits).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from kvtier.errors import ConfigError
from kvtier.units import parse_size
from kvtier.validation import MAX_SECONDS, NOT_A_BOOL, NoBoolNumbers, explain

MAX_LIFETIME_SECONDS = 365 * 24 * 3600.0
"""The longest lifetime of a stored value a tier option takes (one year; a wait is bounded by
:data:`~kvtier.validation.MAX_SECONDS`)."""

MAX_BYTES = 1 << 60
"""The largest byte size any tier option takes (1 EiB)."""

MAX_THREADS = 256
"""The most I/O threads a tier may start."""

MAX_QUEUED = 1 << 20
"""The longest queue of waiting stores a tier may keep."""


def _size(value: Any) -> Any:
    if value is None:
        return None
    try:
        return parse_size(value)
    except (OverflowError, ValueError) as exc:  # ConfigError is a ValueError: pydantic reports it as the field's
        raise ValueError(str(exc) if isinstance(exc, ConfigError) else f"size {value!r} is out of range") from None


ByteSize = Annotated[int, BeforeValidator(_size), Field(ge=0, le=MAX_BYTES)]
"""Bytes as an exact int or a size string (``"512MiB"``, ``"4GiB"``, ``"4GB"``), at most 1 EiB."""

Seconds = Annotated[float, NOT_A_BOOL, Field(le=MAX_SECONDS)]
"""A finite duration in seconds, at most :data:`~kvtier.validation.MAX_SECONDS` (each option
states its lower bound): the bound of every wait in kvtier."""

LifetimeSeconds = Annotated[float, NOT_A_BOOL, Field(le=MAX_LIFETIME_SECONDS)]
"""How long a stored value lives (a TTL), at most one year."""

Threads = Annotated[int, Field(ge=1, le=MAX_THREADS)]
"""A number of I/O threads: 1 to 256."""

QueueLength = Annotated[int, Field(ge=1, le=MAX_QUEUED)]
"""A bound on waiting work items: 1 to 1,048,576."""


class TierOptions(NoBoolNumbers):
    """Base of tier options models: unknown options are errors, numbers are finite, and
    validated options are immutable."""

    # hide_input_in_errors: a bad value may hold a secret (a password in a URL); messages name it.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, hide_input_in_errors=True)

    def capacity(self) -> int | None:
        """The byte capacity these options give the tier; None when its medium sets it (a
        server's memory, a bucket, the free disk space found at start)."""
        return None


Admission = Literal["all", "learned"]
"""How a secondary tier admits cascades: ``all`` (every stored block) or ``learned`` (see
:class:`CascadeOptions`)."""


class CascadeOptions(BaseModel):
    """Options every secondary tier takes beside its own, read by the manager, never passed to
    the tier: how the manager feeds the tier (declared once here for every tier type)."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    admission: Admission = Field(
        default="all",
        description="Which stored blocks are cascaded to this tier: all (every one) or learned (those the "
        "CPU tier's eviction policy predicts will be read again within the tier's horizon often enough to "
        "be worth the write; a policy that predicts nothing, such as lru, admits all; the last request "
        "of a conversation with an earlier store here, by its kvtier_session and kvtier_session_end "
        "hints, is not written).",
    )


CASCADE_OPTIONS = frozenset(CascadeOptions.model_fields)
"""The names of :class:`CascadeOptions`' fields: taken out of a tier spec before the tier sees it."""


def split_cascade_options(options: Mapping[str, Any], where: str) -> tuple[dict[str, Any], CascadeOptions]:
    """``options`` without the cascade options, and those validated. ``where`` starts an error
    message (``"tiers[0] (fs)"``); raises :class:`ConfigError` naming the option and the fix."""
    own = {k: v for k, v in options.items() if k not in CASCADE_OPTIONS}
    try:
        cascade = CascadeOptions.model_validate({k: v for k, v in options.items() if k in CASCADE_OPTIONS})
    except ValidationError as exc:
        raise ConfigError(f"{where} has bad options: " + explain(exc, CascadeOptions, prefix="option")) from None
    return own, cascade


OptionsT = TypeVar("OptionsT", bound=BaseModel)


def validate_options(model: type[OptionsT], tier_type: str, options: Mapping[str, Any]) -> OptionsT:
    """``options`` validated by ``model``; raises :class:`ConfigError` naming each bad option and the fix."""
    try:
        return model.model_validate(dict(options))
    except ValidationError as exc:
        raise ConfigError(f"{tier_type} tier has bad options: " + explain(exc, model, prefix="option")) from None


def tier_options(
    model: type[OptionsT], tier_type: str, options: OptionsT | None, fields: Mapping[str, Any]
) -> OptionsT:
    """What a tier constructor was given: an instance of ``model``, keyword ``fields``, or an
    instance changed by ``fields``, validated by ``model``. Raises :class:`ConfigError`
    naming each bad option (or the wrong type of ``options``)."""
    if options is None:
        return validate_options(model, tier_type, fields)
    if not isinstance(options, model):
        raise ConfigError(
            f"{tier_type} tier options must be a {model.__name__} (or keyword arguments), "
            f"got {type(options).__name__}"
        )
    if not fields:
        return options
    return validate_options(model, tier_type, {**options.model_dump(exclude_unset=True), **fields})


__all__ = [
    "CASCADE_OPTIONS",
    "MAX_BYTES",
    "MAX_LIFETIME_SECONDS",
    "MAX_QUEUED",
    "MAX_SECONDS",
    "MAX_THREADS",
    "Admission",
    "ByteSize",
    "CascadeOptions",
    "LifetimeSeconds",
    "QueueLength",
    "Seconds",
    "Threads",
    "TierOptions",
    "split_cascade_options",
    "tier_options",
    "validate_options",
]
