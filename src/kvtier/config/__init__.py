"""One configuration schema for the whole stack, and its loaders.

The package, by concern:

* :mod:`kvtier.config.presets`: known model layouts (``model: qwen2.5-7b``);
* :mod:`kvtier.config.schema`: :class:`KvtierConfig`, the validated schema;
* :mod:`kvtier.config.load`: file < ``KVTIER_*`` environment < CLI flags;
* :mod:`kvtier.config.build`: a config to a :class:`~kvtier.manager.TieringManager`;
* :mod:`kvtier.config.docs`: the Markdown reference (``docs/configuration.md``).

Sizes (``parse_size``, ``format_size``) live in :mod:`kvtier.units` and are
re-exported here, as is every public name of the package.
"""

from kvtier.config.build import build_manager, describe_config
from kvtier.config.docs import render_config_reference
from kvtier.config.load import ENV_PREFIX, cli_flag, env_var, load_config
from kvtier.config.presets import MODEL_PRESETS, find_preset
from kvtier.config.schema import DEFAULT_CPU_BYTES, GeometryConfig, KvtierConfig
from kvtier.units import format_size, parse_size, row_stride_for

__all__ = [
    "DEFAULT_CPU_BYTES",
    "ENV_PREFIX",
    "MODEL_PRESETS",
    "GeometryConfig",
    "KvtierConfig",
    "build_manager",
    "cli_flag",
    "describe_config",
    "env_var",
    "find_preset",
    "format_size",
    "load_config",
    "parse_size",
    "render_config_reference",
    "row_stride_for",
]
