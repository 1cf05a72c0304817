"""``docs/configuration.md``, generated from the schema, the presets and the tier registry.

Pure apart from importing the built-in tier modules (to read their options
models); any thread. ``kvtier config reference`` prints it; a test keeps the
file in step.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kvtier.config.load import cli_flag, env_var
from kvtier.config.presets import MODEL_PRESETS
from kvtier.config.schema import BackpressureConfig, GeometryConfig, KvtierConfig
from kvtier.errors import ConfigError

_INTRO = """\
# Configuration reference

<!-- Generated from kvtier.config and the tier registry by `kvtier config reference`;
     tests/test_config.py keeps it in step. -->

kvtier reads one configuration from, in increasing precedence: a file (YAML, TOML
or JSON, fields at the top level or under a `kvtier` section), environment
variables `KVTIER_<FIELD>`, and CLI flags `--<field-with-dashes>`. Nested values
(`geometry`, `backpressure`, `tiers`) are JSON in environment variables and flags.
`geometry` and `backpressure` are merged key by key across sources; `tiers` is
replaced as a whole; `cpu_bytes` and
`num_cpu_blocks` are one setting (the highest-precedence source wins).
`kvtier config show` prints the resolved values and where each one came from.

Sizes accept bytes or units: `512MiB`, `4GiB`, `4G` (binary), `4GB` (decimal).
"""

_EXAMPLE = """\
## Example

```yaml
cpu_bytes: 8GiB
policy: lru
model: llama-3.1-8b
geometry:
  tokens_per_block: 16
tiers:
  - type: fs
    root: /mnt/nvme/kvtier
    max_bytes: 200GiB
  - type: redis
    url: redis://cache.internal:6379/0
    ttl_seconds: 3600
```
"""


def _number(value: float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and value >= 2**30 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _bounds_text(metadata: list[Any]) -> str:
    """`` (>= 1, <= 256)`` from annotated_types constraints, the tightest of each side (empty if none)."""
    low: tuple[float, str] | None = None
    high: tuple[float, str] | None = None
    for meta in metadata:
        for kind, sign in (("gt", ">"), ("ge", ">=")):
            value = getattr(meta, kind, None)
            if value is not None and (low is None or value > low[0] or (value == low[0] and sign == ">")):
                low = (value, sign)
        for kind, sign in (("lt", "<"), ("le", "<=")):
            value = getattr(meta, kind, None)
            if value is not None and (high is None or value < high[0]):
                high = (value, sign)
    parts = [f"{bound[1]} {_number(bound[0])}" for bound in (low, high) if bound is not None]
    return f" ({', '.join(parts)})" if parts else ""


def _constraints(annotation: Any) -> tuple[Any, list[Any]]:
    """``annotation`` without ``Annotated``, and the constraints it carried."""
    if typing.get_origin(annotation) is typing.Annotated:
        base, *extra = typing.get_args(annotation)
        return base, [m for e in extra for m in (e.metadata if isinstance(e, FieldInfo) else [e])]
    return annotation, []


def _type_text(annotation: Any, metadata: list[Any] | None = None) -> str:
    """A type for people: ``int (>= 1, <= 256)``, ``size (> 0, <= 2^60) | None``; ``metadata``
    (the field's own constraints) applies to the member that is not None."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = typing.get_args(annotation)
        own = metadata if sum(m is not type(None) for m in members) == 1 else None
        return " \\| ".join("None" if m is type(None) else _type_text(m, own) for m in members)
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f"`{value}`" for value in typing.get_args(annotation))
    base, carried = _constraints(annotation)
    carried += metadata or []
    if any(getattr(getattr(m, "func", None), "__name__", "") == "_size" for m in carried):
        return "size" + _bounds_text(carried)
    text = str(base).replace("typing.", "")
    text = re.sub(r"<class '([^']+)'>", r"\1", text)
    return _cell(re.sub(r"\bkvtier(\.\w+)*\.(\w+)", r"\2", text)) + _bounds_text(carried)


def _cell(text: object) -> str:
    """Text safe inside a Markdown table cell (reST roles and double backquotes made plain)."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", str(text)).replace("``", "`")
    return text.replace("|", "\\|").replace("\n", " ")


def _default_text(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
        if value == []:
            return "`[]`"
        return "(see below)" if isinstance(value, BackpressureConfig) else "(from preset)"
    return f"`{info.default!r}`" if info.default is not None else "-"


def _top_level_table() -> list[str]:
    lines = [
        "## Top-level fields",
        "",
        "| field | env var | CLI flag | type | default | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for name, info in KvtierConfig.model_fields.items():
        lines.append(
            f"| `{name}` | `{env_var(name)}` | `{cli_flag(name)}` | {_type_text(info.annotation, info.metadata)} | "
            f"{_default_text(info)} | {_cell(info.description)} |"
        )
    lines += ["", "## `geometry`", "", "| field | type | meaning |", "|---|---|---|"]
    for name, info in GeometryConfig.model_fields.items():
        lines.append(f"| `{name}` | {_type_text(info.annotation)} | {_cell(info.description)} |")
    intro = " ".join((BackpressureConfig.__doc__ or "").split())
    lines += ["", "## `backpressure`", "", _cell(intro), "", *options_table(BackpressureConfig)]
    return lines


def _presets_table() -> list[str]:
    lines = [
        "## Model presets",
        "",
        "| preset | model id | layers | KV heads | head dim | kv_factor |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in MODEL_PRESETS.items():
        lines.append(
            f"| `{name}` | `{p['model_id']}` | {p['num_layers']} | {p['num_kv_heads']} | "
            f"{p['head_dim']} | {p.get('kv_factor', 2)} |"
        )
    return lines


def options_table(model: type[BaseModel]) -> list[str]:
    """A Markdown table of a tier's options model: name, type, default, meaning."""
    lines = ["| option | type | default | meaning |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        lines.append(
            f"| `{name}` | {_type_text(info.annotation, info.metadata)} | {_default_text(info)} | "
            f"{_cell(info.description)} |"
        )
    return lines


def _tier_sections() -> list[str]:
    from kvtier.tiers.options import CascadeOptions
    from kvtier.tiers.registry import builtin_tier_names, resolve_tier_class

    lines: list[str] = [
        "## Options every tier takes",
        "",
        _cell(" ".join((CascadeOptions.__doc__ or "").split())),
        "",
        *options_table(CascadeOptions),
        "",
    ]
    for name in builtin_tier_names():
        lines += [f"## Tier `{name}`", ""]
        try:
            cls = resolve_tier_class(name)
        except ConfigError as exc:
            lines += [f"(options unavailable here: {_cell(exc)})", ""]
            continue
        model = cls.options_model
        if model is None:
            lines += [f"`{cls.__module__}.{cls.__qualname__}` takes its constructor's keyword arguments.", ""]
            continue
        lines += [_cell((model.__doc__ or "").strip().splitlines()[0] if model.__doc__ else ""), ""]
        lines += [*options_table(model), ""]
    lines += [
        "Out-of-tree tiers use `type: package.module:ClassName` (or a name given to",
        "`kvtier.tiers.registry.register_tier`). A tier class that sets `options_model` (a",
        "pydantic model) has its options validated by it when the configuration is loaded;",
        "otherwise they are checked against its constructor's keyword arguments.",
        "",
    ]
    return lines


def render_config_reference() -> str:
    """The Markdown of ``docs/configuration.md``, generated from the schema and the tier registry."""
    lines = [_INTRO, *_top_level_table(), "", *_presets_table(), "", *_tier_sections(), _EXAMPLE]
    return "\n".join(lines)
