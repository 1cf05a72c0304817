"""The JSON Schema of a kvtier configuration file, as ``kvtier config schema`` prints it.

pydantic's schema of :class:`~kvtier.config.schema.KvtierConfig` is close, but a few of its
fields are read more widely than their Python types say, and constraints given through
``Annotated`` types come out under pydantic's own names (``ge``, ``le``) that JSON Schema
validators ignore. This module makes the schema say what a configuration file may hold: sizes
as integers or strings like ``"4GiB"``, ``shutdown_timeout`` as ``"none"`` too, and bounds as
``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum``. Pure function; any thread.
"""

from __future__ import annotations

from typing import Any

from kvtier.config.schema import KvtierConfig

SIZE_PATTERN = r"^\s*[0-9]+(\.[0-9]+)?\s*([bB]|[kKmMgGtTpPeE]([iI]?[bB])?)?\s*$"
"""A size string :func:`kvtier.units.parse_size` reads: a number and a unit (``4GiB``, ``512MiB``, ``4G``, ``4GB``)."""

SIZE_FIELDS = ("cpu_bytes",)
"""Top-level fields that are sizes (an integer of bytes, or a size string)."""

NONE_AS_TEXT = ("shutdown_timeout",)
"""Top-level fields whose null may be written ``"none"`` (as text, in the environment)."""

SECTION_DEF = "KvtierFields"
"""The name in ``$defs`` of the fields' schema (taken at the top level or under ``kvtier:``)."""

_BOUNDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}
_NAMED = ("properties", "$defs", "patternProperties")  # maps of names to schemas: their keys are names


def config_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a kvtier configuration file's fields."""
    schema: dict[str, Any] = _standard_bounds(KvtierConfig.model_json_schema())
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    fields = schema["properties"]
    for name in SIZE_FIELDS:
        _also(fields[name], {"type": "string", "pattern": SIZE_PATTERN})
    for name in NONE_AS_TEXT:
        _also(fields[name], {"type": "string", "pattern": r"^\s*[nN][oO][nN][eE]\s*$"})
    return _or_in_a_section(schema)


def _or_in_a_section(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (the fields at the top level) also taking the fields under a ``kvtier:`` section,
    the file's only key, as the loader does: the fields' schema moves to ``$defs``."""
    defs = schema.pop("$defs", {})
    top: dict[str, Any] = {k: schema.pop(k) for k in ("$schema", "title", "description") if k in schema}
    defs[SECTION_DEF] = schema
    ref = {"$ref": f"#/$defs/{SECTION_DEF}"}
    section = {"type": "object", "properties": {"kvtier": ref}, "required": ["kvtier"], "additionalProperties": False}
    return {**top, "$defs": defs, "anyOf": [ref, section]}


def _also(field: dict[str, Any], option: dict[str, Any]) -> None:
    """Let ``field`` also be ``option`` (its description and default kept)."""
    if "anyOf" not in field:
        kept: dict[str, Any] = {k: field.pop(k) for k in ("title", "description", "default") if k in field}
        inner = dict(field)
        field.clear()
        field.update(kept, anyOf=[inner])
    field["anyOf"].append(option)


def _standard_bounds(node: Any, names: bool = False) -> Any:
    """``node`` with pydantic's bound keys renamed to JSON Schema's, recursively (not the keys of a
    map of names, such as ``properties``: a field may be called ``ge``)."""
    if isinstance(node, list):
        return [_standard_bounds(item) for item in node]
    if not isinstance(node, dict):
        return node
    if names:
        return {key: _standard_bounds(value) for key, value in node.items()}
    return {_BOUNDS.get(key, key): _standard_bounds(value, key in _NAMED) for key, value in node.items()}


__all__ = ["SIZE_PATTERN", "config_json_schema"]
