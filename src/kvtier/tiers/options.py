"""Tier options: the base of every tier's options model and its validation in constructors.

A tier declares its options as a pydantic model (``SecondaryTier.options_model``)
whose fields carry a ``description`` (the generated ``docs/configuration.md``
shows them); the registry validates config specs through it. Tiers built on
this module also take their options as keyword arguments and call
:func:`validate_options`, so the model is the one place that holds names,
types, defaults and bounds, whether the tier is built from a config file or
from Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from kvtier.errors import ConfigError
from kvtier.units import parse_size
from kvtier.validation import explain


def _size(value: Any) -> Any:
    return value if value is None else parse_size(value)


ByteSize = Annotated[int, BeforeValidator(_size)]
"""Bytes as an int or a size string (``"512MiB"``, ``"4GiB"``, ``"4GB"``)."""


class TierOptions(BaseModel):
    """Base of tier options models: unknown options are errors; validated options are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


OptionsT = TypeVar("OptionsT", bound=BaseModel)


def validate_options(model: type[OptionsT], tier_type: str, options: Mapping[str, Any]) -> OptionsT:
    """``options`` validated by ``model``; raises :class:`ConfigError` naming each bad option and the fix."""
    try:
        return model.model_validate(dict(options))
    except ValidationError as exc:
        raise ConfigError(f"{tier_type} tier has bad options: " + explain(exc, model, prefix="option")) from None


__all__ = ["ByteSize", "TierOptions", "validate_options"]
