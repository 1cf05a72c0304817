"""Tier options: the base of every tier's options model and its validation.

A tier declares its options as a pydantic model (``SecondaryTier.options_model``)
whose fields carry a ``description`` (the generated ``docs/configuration.md``
shows them). Its constructor takes the options as keyword arguments and calls
:func:`validate_options`, so the model is the one place that holds names,
types, defaults and bounds, whether the tier is built from a config file or
from Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from kvtier.errors import ConfigError


def _size(value: Any) -> Any:
    from kvtier.config import parse_size

    return value if value is None else parse_size(value)


ByteSize = Annotated[int, BeforeValidator(_size)]
"""Bytes as an int or a size string (``"512MiB"``, ``"4GiB"``, ``"4GB"``)."""


class TierOptions(BaseModel):
    """Base of tier options models: unknown options are errors, values are re-checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)


OptionsT = TypeVar("OptionsT", bound=BaseModel)


def explain_validation_error(exc: ValidationError) -> str:
    """One readable clause per pydantic error: the option, what is wrong, the value given."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "options"
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "is not an option"
        elif "input" in err and err["type"] not in ("value_error", "assertion_error", "missing"):
            msg = f"{msg} (got {err['input']!r})"
        parts.append(f"{loc!r} {msg}")
    return "; ".join(parts)


def validate_options(model: type[OptionsT], tier_type: str, options: Mapping[str, Any]) -> OptionsT:
    """``options`` validated by ``model``; raises :class:`ConfigError` naming each bad option."""
    try:
        return model.model_validate(dict(options))
    except ValidationError as exc:
        known = sorted(model.model_fields)
        raise ConfigError(
            f"{tier_type} tier: bad options: {explain_validation_error(exc)} (options are {known})"
        ) from None


__all__ = ["ByteSize", "TierOptions", "explain_validation_error", "validate_options"]
