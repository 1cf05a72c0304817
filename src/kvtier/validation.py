"""Pydantic validation errors as one readable line, and the shared rules for numbers.

:func:`explain` turns a validation error into one line naming the field, its
source, the bad value (shortened) and the fix; the configuration loader and the
tier registry use it, so a bad top-level setting and a bad tier option read alike.

Numbers (durations, counts) follow one rule everywhere they enter kvtier (file,
environment, flag, Python API, a tier's options): finite, within a stated range,
or refused with a :class:`~kvtier.errors.ConfigError` naming the setting.
:data:`Seconds` and :data:`PositiveSeconds` are the pydantic forms,
:func:`check_seconds` the one for plain arguments. Pure; any thread.
"""

from __future__ import annotations

import difflib
import itertools
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, ValidationError, model_validator

from kvtier.errors import BoundedRepr, ConfigError, int_text
from kvtier.units import HOLDS_URL, type_and_size

MAX_SECONDS = 1_000_000.0
"""The longest duration any kvtier setting accepts (about 11.6 days). Waits are handed to
``threading``, which overflows far below ``1e400``; longer or non-finite values are refused."""


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):  # pydantic would take true as 1.0 second
        raise ValueError(f"a number of seconds, not {str(value).lower()}")
    return value


def _leaf_types(annotation: Any) -> set[Any]:
    """The types an annotation admits, through ``Annotated``, ``Optional`` and unions."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _leaf_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_leaf_types(arg) for arg in typing.get_args(annotation)))
    if origin is Literal:  # Literal[1, 2] admits numbers (pydantic takes True for 1: True == 1)
        return {type(arg) for arg in typing.get_args(annotation)}
    return {annotation}


def _validated_before(annotation: Any) -> bool:
    """An ``Annotated`` type in ``annotation`` (through unions) carries a BeforeValidator."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return any(isinstance(m, BeforeValidator) for m in typing.get_args(annotation)[1:])
    if origin in (typing.Union, types.UnionType):
        return any(_validated_before(arg) for arg in typing.get_args(annotation))
    return False


def _has_before_decorator(model: type[BaseModel], name: str) -> bool:
    """``name`` has a ``field_validator`` of ``model`` that sees the raw input (mode before, wrap or plain)."""
    decorators = model.__pydantic_decorators__.field_validators.values()
    return any(name in d.info.fields and d.info.mode != "after" for d in decorators)


def refuse_bool_numbers(model: type[BaseModel], data: Any) -> Any:
    """A ``model_validator(mode="before")`` body: ``true``/``false`` given for a numeric field
    (an int or a float, not a bool) is refused, naming the field; pydantic would read them as
    1 and 0 (``num_cpu_blocks: true`` would mean one block). A field with a before-validator of
    its own (an annotation or a ``field_validator``) is left to it: it refuses a bool itself, and
    its error carries the field's location, so a loader can say where the value came from."""
    if isinstance(data, Mapping):
        for name, value in data.items():
            field = model.model_fields.get(name) if isinstance(value, bool) else None
            if field is None or any(isinstance(m, BeforeValidator) for m in field.metadata) \
                    or _validated_before(field.annotation) or _has_before_decorator(model, name):
                continue  # a field with its own before-validator words its own refusal (sizes, seconds)
            leaves = _leaf_types(field.annotation)
            if bool not in leaves and Any not in leaves and leaves & {int, float}:
                raise ValueError(f"{name} must be a number, not {str(value).lower()}")
    return data


class NoBoolNumbers(BaseModel):
    """Base of the settings models: ``true``/``false`` given for a numeric field is refused
    (:func:`refuse_bool_numbers`)."""

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, data: Any) -> Any:
        return refuse_bool_numbers(cls, data)


NOT_A_BOOL = BeforeValidator(_not_a_bool)
"""Refuses ``true``/``false`` where a number of seconds is expected (pydantic reads them as 1 and 0)."""

Seconds = Annotated[float, NOT_A_BOOL, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
"""A duration setting: a finite number of seconds in [0, :data:`MAX_SECONDS`]."""

PositiveSeconds = Annotated[float, NOT_A_BOOL, Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]
"""A duration setting that must be above zero: seconds in (0, :data:`MAX_SECONDS`]."""


def check_seconds(
    value: Any, name: str, *, allow_none: bool = False, positive: bool = False,
    bounds: tuple[float, float] | None = None, none_means: str = "no deadline",
) -> float | None:
    """``value`` as a duration in seconds, or raise :class:`ConfigError` naming ``name``, the value and the fix.

    Accepts an int or float that is finite and in [0, :data:`MAX_SECONDS`]
    ((0, ...] when ``positive``; ``[low, high]`` when ``bounds`` is given); None only
    when ``allow_none`` (``none_means``: what None stands for, "no deadline" by default). For
    arguments of the Python API (a manager's timeouts), where pydantic does not run.
    """
    if value is None and allow_none:
        return None
    none = f" or None ({none_means})" if allow_none else ""
    if bounds is not None:
        low, high = bounds
        fix = f"give a number of seconds from {low:g} to {high:g}{none}"
    else:
        low, high = 0.0, MAX_SECONDS
        fix = f"give a number of seconds {'above 0' if positive else 'at least 0'} and at most {high:.0f}{none}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number of seconds, got {type(value).__name__} {shown_value(value)}: {fix}")
    if isinstance(value, int) and value > high:  # a 400-digit int too, before float() overflows
        raise ConfigError(f"{name}={int_text(value)} is longer than {high:g} seconds: {fix}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < low or (positive and seconds == 0) or seconds > high:
        raise ConfigError(f"{name}={value!r} is not a usable duration: {fix}")
    return seconds


_SHORT_REPR = BoundedRepr()
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 60
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = _SHORT_REPR.maxdict = _SHORT_REPR.maxset = 4
_SHORT_REPR.maxlevel = 3
_SHORT_REPR.maxlong = 40


def _shown_input(value: Any) -> str:
    """The value a setting got, for a message: a repr of at most about 60 characters, however large
    or deeply nested the value (a YAML alias bomb included: only what is shown is ever visited).
    It may cut a URL's '@' away and keep its password: decide what to hide with
    :func:`_why_not_shown` on the whole value first."""
    text = _SHORT_REPR.repr(value)
    return text if len(text) <= 80 else text[:60] + "..."


_WALK_ITEMS = 10_000
_WALK_DEPTH = 8
_UNCHECKED = "it is too large or too deep to check for a URL with credentials"


def _why_not_shown(value: Any) -> str | None:
    """Why ``value`` must not be shown in a message, or None. Walked whole (not as shortened for a
    message): an '@' or a '://' in a string or bytes anywhere (itself, an item of a list, tuple or
    set, a key or value of a mapping) may be a URL's userinfo or a secret in its query
    (``['redis://user:pw@host']``, ``['rediss://h/0?password=pw']``), and a shortened display can
    cut the '@' away but keep the password. The walk visits at most 10,000 items and 8
    levels (a YAML alias bomb stops there); a value past either bound is not shown either."""
    budget = _WALK_ITEMS
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str | bytes | bytearray):
            if ("@" in item or "://" in item) if isinstance(item, str) else (b"@" in item or b"://" in item):
                return HOLDS_URL
            continue
        if isinstance(item, Mapping):
            children: Any = itertools.chain.from_iterable(item.items())
        elif isinstance(item, list | tuple | set | frozenset):
            children = item
        else:
            continue
        if depth >= _WALK_DEPTH:
            return _UNCHECKED
        for child in children:
            budget -= 1
            if budget < 0:
                return _UNCHECKED
            stack.append((child, depth + 1))
    return None


def shown_value(value: Any) -> str:
    """Any value, for a message: a bounded repr (:func:`_shown_input`: at most about 80 characters,
    in bounded time and memory however large or deeply nested, a YAML alias bomb included), or, when
    it may hold a secret (:func:`_why_not_shown`, judged on the whole value before shortening), its
    type and why it is not shown."""
    why = _why_not_shown(value)
    if why is None:
        text = _shown_input(value)
        if "@" not in text and "://" not in text:  # an object whose repr holds one
            return text
        why = HOLDS_URL
    return f"{type_and_size(value)}, not shown: {why}"


def is_utf8_text(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8: a value from argv, a file name or a config text whose bytes
    were not UTF-8 arrives with lone surrogates, which no host, path, key or JSON answer can hold."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def did_you_mean(unknown: Sequence[str], known: Sequence[str]) -> str:
    """``'read_thread' (did you mean 'read_threads'?)`` for each unknown name, comma separated."""
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, list(known), n=1)
        parts.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    return ", ".join(parts)


def _submodel(model: type[BaseModel], loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The model that validates the value at ``loc`` inside ``model`` (nested BaseModel fields only)."""
    current: type[BaseModel] = model
    for part in loc:
        info = current.model_fields.get(str(part))
        if info is None:
            return None
        found = None
        candidates = (info.annotation, *typing.get_args(info.annotation))
        for candidate in candidates:
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                found = candidate
                break
        if found is None:
            return None
        current = found
    return current


_SECRET_NAME = re.compile(r"(^|_)(password|passwd|secret|credentials?)(_|$)|(^|_)token$|^access_key", re.IGNORECASE)


def _is_secret(model: type[BaseModel], loc: Sequence[int | str]) -> bool:
    """True when the value at ``loc`` is (inside) a ``SecretStr`` field or one named like a secret:
    its input is never shown (an all-digit secret that YAML read as a number included)."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and _SECRET_NAME.search(part):
            return True
        owner = _submodel(model, loc[:i])
        info = owner.model_fields.get(str(part)) if owner is not None else None
        if info is not None and "SecretStr" in repr(info.annotation):
            return True
    return False


def _is_union_member(model: type[BaseModel], loc: Sequence[int | str]) -> bool:
    """True when ``loc[-1]`` is pydantic's tag of a union member (``'bool'``, ``"literal['auto']"``), not a name."""
    if len(loc) < 2 or not isinstance(loc[-1], str):
        return False
    owner = _submodel(model, loc[:-2])
    info = owner.model_fields.get(str(loc[-2])) if owner is not None else None
    return info is not None and typing.get_origin(info.annotation) in (typing.Union, types.UnionType)


def explain(
    exc: ValidationError,
    model: type[BaseModel],
    *,
    prefix: str = "config field",
    sources: Mapping[str, str] | None = None,
) -> str:
    """One readable line per invalid field of ``exc`` (raised by ``model``), joined by ``"; "``.

    Each line names the field (``prefix 'loc'``), where its value came from
    (``sources[top-level field]``), what is wrong with the value it got and, for
    an unknown name, the close match and the known names. The failures of the
    members of a union (``bool | Literal['auto']``) are one line.
    """
    problems: dict[tuple[int | str, ...], list[str]] = {}
    for err in exc.errors():
        loc = tuple(err["loc"])
        if _is_union_member(model, loc):
            loc = loc[:-1]
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            owner = _submodel(model, loc[:-1])
            known = list(owner.model_fields) if owner is not None else []
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            msg = "is not a setting"
            if close:
                msg += f" (did you mean {close[0]!r}?)"
            if known:
                msg += f": known names are {known}"
        elif "input" in err and err["type"] not in ("value_error", "assertion_error"):
            secret = _is_secret(model, loc)
            shown = "a value, not shown: it is a secret" if secret else shown_value(err["input"])
            msg = f"{msg} (got {shown})"
        problems.setdefault(loc, []).append(msg)
    lines = []
    for loc, messages in problems.items():
        name = ".".join(str(p) for p in loc)
        top = str(loc[0]) if loc else ""
        where = f" (from {sources[top]})" if sources and top in sources else ""
        label = f"{prefix} {name!r}" if prefix and name else (name or prefix.split(" ")[0] or "config")
        lines.append(f"{label}{where}: " + "; or ".join(messages))
    return "; ".join(lines)
