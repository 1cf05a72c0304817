"""Pydantic validation errors as one readable line: the field, its source, the bad value, the fix.

Used by the configuration loader and the tier registry, so a bad top-level
setting and a bad tier option read alike. Pure; any thread.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ValidationError


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
            msg = f"{msg} (got {err['input']!r})"
        problems.setdefault(loc, []).append(msg)
    lines = []
    for loc, messages in problems.items():
        name = ".".join(str(p) for p in loc)
        top = str(loc[0]) if loc else ""
        where = f" (from {sources[top]})" if sources and top in sources else ""
        label = f"{prefix} {name!r}" if prefix and name else (name or prefix.split(" ")[0] or "config")
        lines.append(f"{label}{where}: " + "; or ".join(messages))
    return "; ".join(lines)
