"""``docs/configuration.md``, generated from the schema, the presets and the tier registry.

Pure; any thread. ``kvtier config reference`` prints it; a test keeps the file in step.
"""

from __future__ import annotations

import re
from typing import Any

from kvtier.config.load import cli_flag, env_var
from kvtier.config.presets import MODEL_PRESETS
from kvtier.config.schema import _TIER_SCHEMAS, GeometryConfig, KvtierConfig


def _type_text(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "")
    return _cell(re.sub(r"<class '([^']+)'>", r"\1", text).replace("kvtier.config.schema.", ""))


def _cell(text: object) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|")


def render_config_reference() -> str:
    """The Markdown of ``docs/configuration.md``, generated from the schema."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from kvtier.config by `kvtier config reference`;",
        "     tests/test_config.py keeps it in step. -->",
        "",
        "kvtier reads one configuration from, in increasing precedence: a file (YAML, TOML",
        "or JSON, fields at the top level or under a `kvtier` section), environment",
        "variables `KVTIER_<FIELD>`, and CLI flags `--<field-with-dashes>`. Nested values",
        "(`geometry`, `tiers`) are JSON in environment variables and flags. `geometry` is",
        "merged key by key across sources; `tiers` is replaced as a whole; `cpu_bytes` and",
        "`num_cpu_blocks` are one setting (the highest-precedence source wins).",
        "",
        "Sizes accept bytes or units: `512MiB`, `4GiB`, `4G` (binary), `4GB` (decimal).",
        "",
        "## Top-level fields",
        "",
        "| field | env var | CLI flag | type | default | meaning |",
        "|---|---|---|---|---|---|",
    ]

    def default_text(info: Any) -> str:
        if info.default_factory is not None:
            value = info.default_factory()
            return "`[]`" if value == [] else "(from preset)"
        return f"`{info.default!r}`" if info.default is not None else "-"

    for name, info in KvtierConfig.model_fields.items():
        lines.append(
            f"| `{name}` | `{env_var(name)}` | `{cli_flag(name)}` | "
            f"{_type_text(info.annotation)} | "
            f"{default_text(info)} | {_cell(info.description)} |"
        )
    lines += ["", "## `geometry`", "", "| field | type | meaning |", "|---|---|---|"]
    for name, info in GeometryConfig.model_fields.items():
        lines.append(f"| `{name}` | {_type_text(info.annotation)} | {_cell(info.description)} |")
    lines += [
        "",
        "## Model presets",
        "",
        "| preset | model id | layers | KV heads | head dim | kv_factor |",
    ]
    lines.append("|---|---|---|---|---|---|")
    for name, p in MODEL_PRESETS.items():
        lines.append(
            f"| `{name}` | `{p['model_id']}` | {p['num_layers']} | {p['num_kv_heads']} | "
            f"{p['head_dim']} | {p.get('kv_factor', 2)} |"
        )
    for tier_type, schema in _TIER_SCHEMAS.items():
        lines += ["", f"## Tier `{tier_type}`", "", str(schema.__doc__ or "").strip(), ""]
        lines += ["| option | type | meaning |", "|---|---|---|"]
        for name, info in schema.model_fields.items():
            if name == "type":
                continue
            required = " (required)" if info.is_required() else ""
            lines.append(f"| `{name}`{required} | {_type_text(info.annotation)} | {_cell(info.description)} |")
    lines += [
        "",
        "Other options are passed to the tier class as keyword arguments and checked against its",
        "constructor. Out-of-tree tiers use `type: package.module:ClassName`.",
        "",
        "## Example",
        "",
        "```yaml",
        "cpu_bytes: 8GiB",
        "policy: lru",
        "model: llama-3.1-8b",
        "geometry:",
        "  tokens_per_block: 16",
        "tiers:",
        "  - type: fs",
        "    root: /mnt/nvme/kvtier",
        "    max_bytes: 200GiB",
        "  - type: redis",
        "    url: redis://cache.internal:6379/0",
        "    ttl_seconds: 3600",
        "```",
        "",
    ]
    return "\n".join(lines)
