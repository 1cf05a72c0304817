"""An out-of-tree tier for the registry tests: a memory tier with its own name and one extra option."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from kvtier.tiers.base import TierContext
from kvtier.tiers.memory import MemoryTier, MemoryTierOptions
from kvtier.tiers.options import tier_options


class PluginTierOptions(MemoryTierOptions):
    """A plugin tier for the tests (``type: plugin-mem``)."""

    label_suffix: str = Field(default="", description="Appended to the tier's describe() label.")


class PluginTier(MemoryTier):
    tier_type = "plugin-mem"
    options_model = PluginTierOptions

    def __init__(self, context: TierContext, options: PluginTierOptions | None = None, /, **fields: Any) -> None:
        self.plugin_options = tier_options(PluginTierOptions, self.tier_type, options, fields)
        super().__init__(context, self.plugin_options)  # its model extends the memory tier's

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "label_suffix": self.plugin_options.label_suffix}
