"""Loading the configuration: file < environment < CLI flags, field by field.

The same field names are used everywhere:

* files (YAML ``.yaml``/``.yml``, TOML ``.toml``, JSON ``.json``), either at the
  top level or under a single ``kvtier`` table/section;
* environment variables ``KVTIER_<FIELD>`` (upper case; nested values such as
  ``tiers`` and ``geometry`` are JSON);
* CLI flags ``--<field-with-dashes>`` (nested values as JSON).

An empty ``KVTIER_<FIELD>`` counts as unset. A file must be a regular UTF-8
file of at most 1 MiB (:mod:`kvtier.user_files`); ``shutdown_timeout: null`` in
a file (``none``/``null`` as text) means no deadline, while ``null`` elsewhere
means "not given". Precedence is file < environment < CLI, field by field. ``geometry`` and
``backpressure`` are merged key by key across sources; ``tiers`` is replaced as
a whole. ``cpu_bytes`` and
``num_cpu_blocks`` are one setting: the highest-precedence source that names
either one wins.

Every validation problem raises :class:`~kvtier.errors.ConfigError` whose message
names the field, where its value came from, and the fix. Pure (reads only the
file and the environment mapping it is given); any thread.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvtier.config.schema import KvtierConfig
from kvtier.errors import ConfigError
from kvtier.user_files import load_yaml, read_text, unique_keys
from kvtier.validation import did_you_mean, explain, shown_value

logger = logging.getLogger(__name__)

ENV_PREFIX = "KVTIER_"
_FIELDS = tuple(KvtierConfig.model_fields)
_JSON_FIELDS = {"tiers", "geometry", "backpressure"}
_MERGED_FIELDS = ("geometry", "backpressure")
"""Nested fields merged key by key across sources (the others are replaced as a whole)."""
_CPU_SIZE_FIELDS = ("cpu_bytes", "num_cpu_blocks")
_NULL_MEANS_NONE = ("shutdown_timeout",)
"""Fields whose ``null`` in a file is a value (no deadline), not "not given"; as text: ``none``/``null``."""


def env_var(field: str) -> str:
    """``cpu_bytes`` -> ``KVTIER_CPU_BYTES``."""
    return ENV_PREFIX + field.upper()


def cli_flag(field: str) -> str:
    """``cpu_bytes`` -> ``--cpu-bytes``."""
    return "--" + field.replace("_", "-")


def _read_file(path: str) -> dict[str, Any]:
    """The fields of a config file: a regular UTF-8 file of at most 1 MiB (:func:`kvtier.user_files.read_text`),
    a mapping (or one ``kvtier:`` section holding one) whose keys are all strings; else :class:`ConfigError`."""
    text = read_text(path, "config file").removeprefix("\ufeff")  # a UTF-8 BOM (Windows editors write one)
    suffix = Path(path).suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml", ".json"):
        raise ConfigError(
            f"config file {path!r} has an unknown extension {suffix!r}: use .yaml, .yml, .toml or .json"
        )
    try:
        if suffix in (".yaml", ".yml"):
            data = load_yaml(text)
        elif suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - exercised on 3.10 only
                import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]
            data = tomllib.loads(text)
        else:
            # NaN/Infinity reach the field's validation, which names the field; a key named twice is refused
            data = json.loads(text, object_pairs_hook=unique_keys)
    except ConfigError:
        raise
    except RecursionError:
        raise ConfigError(f"config file {path!r} nests values too deeply to be a kvtier configuration") from None
    except Exception as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(
            f"config file {path!r} is not valid {suffix.lstrip('.').upper()}: {detail[:300]}"
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of fields, got {type(data).__name__}")
    if "kvtier" in data:  # the documented section: alone, and a mapping
        if set(data) != {"kvtier"} or not isinstance(data["kvtier"], dict):
            raise ConfigError(
                f"config file {path!r}: a 'kvtier:' section must be the file's only top-level key and hold a mapping "
                "of fields (or give the fields at the top level, without it)"
            )
        data = data["kvtier"]
    named = [key for key in data if not isinstance(key, str)]  # YAML ``1:``, ``null:``, ``2024-01-01:``
    if named:
        raise ConfigError(
            f"config file {path!r}: {shown_value(named[0])} ({type(named[0]).__name__}) is not a setting's name: "
            f"settings are named by text, e.g. cpu_bytes: 4GiB; known settings are {list(_FIELDS)}"
        )
    return dict(data)


def _parse_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        field = name[len(ENV_PREFIX) :].lower()
        if field not in _FIELDS:
            close = difflib.get_close_matches(field, _FIELDS, n=1)
            if close:
                logger.warning("ignoring %s: not a kvtier setting (did you mean %s?)", name, env_var(close[0]))
            continue
        if not raw.strip():
            continue  # an empty KVTIER_<FIELD> is the same as an unset one
        out[field] = _decode_text(field, raw, source=f"environment variable {name}")
    return out


_BLANK_REFUSED_ON_READ = ("region_name", "cpu_bytes", "num_cpu_blocks")
"""Fields whose blank flag value (from ``load_config(cli=...)``) is refused as it is read, as the command
line refuses an empty flag value: their own checks would take it for "not given". (A blank
``KVTIER_*`` is "not given" for every field: :func:`_parse_env` skips it.)"""


def _decode_text(field: str, raw: Any, *, source: str) -> Any:
    """Non-blank strings from env vars and CLI flags: JSON for nested fields."""
    if not isinstance(raw, str):
        return raw
    if field in _JSON_FIELDS:
        try:
            value = json.loads(raw, object_pairs_hook=unique_keys)
        except RecursionError:
            raise ConfigError(f"{field} from {source} nests values too deeply to be a kvtier setting") from None
        except json.JSONDecodeError as exc:
            example = {
                "tiers": '[{"type": "fs", "root": "/mnt/nvme/kv"}]',
                "geometry": '{"tokens_per_block": 16}',
                "backpressure": '{"high_seconds": 2.0, "low_seconds": 1.0}',
            }[field]
            raise ConfigError(
                f"{field} from {source} is not valid JSON ({exc.msg}): write it as JSON, e.g. {example}"
            ) from None
        except ValueError as exc:  # a key named twice (unique_keys)
            raise ConfigError(f"{field} from {source}: {exc}: give each key once") from None
        if value is None:  # taken as "not given", it would silently keep the file's value
            raise ConfigError(f"{field} from {source} is JSON null, not a value: {_leave_out(source)}")
        return value
    return raw


def _leave_out(source: str) -> str:
    """The fix for a null given where a value is expected: leave the flag out, unset the variable."""
    for prefix, fix in (("environment variable ", "unset {} (or give a value) to use the default"),
                        ("CLI flag ", "leave {} out (or give a value) to use the default")):
        if source.startswith(prefix):
            return fix.format(source.removeprefix(prefix))
    return "leave it out (or give a value) to use the default"


_Layer = tuple[str, dict[str, Any], Callable[[str], str]]
"""(source name, its values, the name of one field's source, e.g. ``"CLI flag --cpu-bytes"``)."""


def _merge(layers: list[_Layer]) -> tuple[dict[str, Any], dict[str, str], dict[str, dict[str, str]]]:
    """Merge layers in increasing precedence; returns the values, each field's source (for a field
    merged key by key, the last source that touched it) and, per merged field, each key's source."""
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    key_sources: dict[str, dict[str, str]] = {}
    for source, data, field_source in layers:
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise ConfigError(
                f"unknown setting(s) {did_you_mean(unknown, _FIELDS)} in {source}: known settings are {list(_FIELDS)}"
            )
        present = [f for f in _CPU_SIZE_FIELDS if data.get(f) is not None]
        if len(present) == 2:
            raise ConfigError(f"cpu_bytes and num_cpu_blocks are both set in {source}: set only one of them")
        if present:
            for f in _CPU_SIZE_FIELDS:
                merged.pop(f, None)
                sources.pop(f, None)
        for field, value in data.items():
            if value is None and not (field in _NULL_MEANS_NONE and source.startswith("file ")):
                continue
            given = field_source(field)
            if field in _MERGED_FIELDS and isinstance(value, Mapping) and isinstance(merged.get(field), dict):
                merged[field] = {**merged[field], **value}
                key_sources[field].update(dict.fromkeys(map(str, value), given))
            else:
                merged[field] = dict(value) if isinstance(value, Mapping) else value
                key_sources[field] = dict.fromkeys(map(str, value), given) if isinstance(value, Mapping) else {}
            sources[field] = given
    return merged, sources, key_sources


def _error_sources(
    exc: ValidationError, sources: dict[str, str], key_sources: dict[str, dict[str, str]]
) -> dict[str, str]:
    """``sources`` for the message of ``exc``: a field merged key by key across sources (``geometry``
    from a file and from ``KVTIER_GEOMETRY``) is named by the source(s) of its keys that failed, not
    by the last source that touched the field."""
    out = dict(sources)
    failed: dict[str, list[str]] = {}
    for err in exc.errors():
        loc = tuple(err["loc"])
        field = str(loc[0]) if loc else ""
        if len(loc) > 1 and str(loc[1]) in key_sources.get(field, {}):
            given = key_sources[field][str(loc[1])]
            if given not in failed.setdefault(field, []):
                failed[field].append(given)
    for field, given_by in failed.items():
        out[field] = " and ".join(given_by)
    return out


def load_config(
    file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
    *,
    cli_source: str = "CLI flags",
    cli_flags: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    defaults_source: str = "defaults",
    layout_from_engine: bool = False,
) -> KvtierConfig:
    """Resolve the configuration from a file, environment variables and CLI values.

    ``env`` defaults to ``os.environ`` (pass ``{}`` to ignore the environment).
    ``cli`` maps field names (underscores) to values; ``None`` values mean "not
    given". Strings for ``tiers``/``geometry`` in env and CLI are parsed as JSON.
    ``cli_source`` names where ``cli`` came from in messages and in
    :attr:`KvtierConfig.sources` (an engine integration passes its own, e.g.
    ``"kv_connector_extra_config"``). ``cli_flags`` names the flag that gave a field when it
    is not ``--<field>`` (``kvtier bench``'s ``--tokens-per-block`` gives ``geometry``).
    ``defaults`` replace the schema's defaults below every other source (a command with its own
    defaults, such as ``kvtier bench``); ``defaults_source`` names them. ``layout_from_engine`` skips the check that
    ``model``/``geometry`` describe a complete KV layout, for an engine that
    supplies the block size itself. Raises :class:`ConfigError` naming the
    field, its source and the fix.
    """
    layers: list[_Layer] = []
    if defaults:
        layers.append((defaults_source, dict(defaults), lambda _field: defaults_source))
    if file is not None:
        file_source = f"file {os.fspath(file)}"
        layers.append((file_source, _read_file(os.fspath(file)), lambda _field: file_source))
    layers.append(("environment", _parse_env(os.environ if env is None else env), env_source))
    if cli:
        field_source = _cli_field_source(cli_source, dict(cli_flags or {}))
        cli_values: dict[str, Any] = {}
        for name, value in cli.items():
            field = name.replace("-", "_")
            if field in _BLANK_REFUSED_ON_READ and isinstance(value, str) and not value.strip():
                raise ConfigError(
                    f"{field} from {field_source(field)} is empty ({value!r}): give a value or leave it out"
                )
            cli_values[field] = _decode_text(field, value, source=field_source(field))
        layers.append((cli_source, cli_values, field_source))
    merged, sources, key_sources = _merge(layers)
    try:
        config = KvtierConfig.model_validate(
            merged, context={"layout_from_engine": layout_from_engine, "sources": sources}
        )
    except ValidationError as exc:
        raise ConfigError(explain(exc, KvtierConfig, sources=_error_sources(exc, sources, key_sources))) from None
    except ConfigError as exc:  # raised inside a validator that pydantic let through
        raise ConfigError(str(exc)) from None
    config.record_sources(sources)
    return config


def _cli_field_source(cli_source: str, flags: Mapping[str, str]) -> Callable[[str], str]:
    """How a field given in ``cli`` is named in messages: its flag, or ``<cli_source>['field']``."""

    def named(field: str) -> str:
        if cli_source != "CLI flags":
            return f"{cli_source}[{field!r}]"
        return f"CLI flag {flags[field]}" if field in flags else cli_flag_source(field)

    return named


def env_source(field: str) -> str:
    """``cpu_bytes`` -> ``"environment variable KVTIER_CPU_BYTES"``."""
    return f"environment variable {env_var(field)}"


def cli_flag_source(field: str) -> str:
    """``cpu_bytes`` -> ``"CLI flag --cpu-bytes"``."""
    return f"CLI flag {cli_flag(field)}"
