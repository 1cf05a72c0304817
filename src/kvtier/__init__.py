"""kvtier: tiered KV-cache offloading for LLM inference engines.

The public API, re-exported; see docs/index.md ("From Python") for a quickstart.
"""

from kvtier.backpressure import BackpressureSettings
from kvtier.errors import (
    ConfigError,
    CorruptValueError,
    ForeignFormatError,
    InsufficientSpaceError,
    InvalidKeyError,
    KvtierError,
    ManagerClosedError,
    RegionBusyError,
    RegionError,
    TierDrainTimeout,
    TierError,
    TierFailure,
    TierShutdownError,
    TierShutdownTimeout,
    UnsafeEntryError,
)
from kvtier.keys import BlockKey, KVGeometry, Namespace, chain_ids, chain_key, prefix_keys, root_key
from kvtier.manager import TieringManager
from kvtier.primary import PrepareStoreResult, PrimaryTier
from kvtier.region import SharedRegion
from kvtier.telemetry import ManagerSnapshot, TierSnapshot
from kvtier.tiers.base import ExtraMetric, JobResult, SecondaryTier, TierContext, TransferJob
from kvtier.tiers.registry import register_tier
from kvtier.types import (
    PRIMARY_LABEL,
    BlockEvent,
    LookupResult,
    OffloadPolicy,
    PrefixLookup,
    RequestContext,
    RequestControl,
    tier_label,
)
from kvtier.version import __version__

__all__ = [
    "PRIMARY_LABEL",
    "BackpressureSettings",
    "BlockEvent",
    "BlockKey",
    "ConfigError",
    "CorruptValueError",
    "ExtraMetric",
    "ForeignFormatError",
    "InsufficientSpaceError",
    "InvalidKeyError",
    "JobResult",
    "KVGeometry",
    "KvtierError",
    "LookupResult",
    "ManagerClosedError",
    "ManagerSnapshot",
    "Namespace",
    "OffloadPolicy",
    "PrefixLookup",
    "PrepareStoreResult",
    "PrimaryTier",
    "RegionBusyError",
    "RegionError",
    "RequestContext",
    "RequestControl",
    "SecondaryTier",
    "SharedRegion",
    "TierContext",
    "TierDrainTimeout",
    "TierError",
    "TierFailure",
    "TierShutdownError",
    "TierShutdownTimeout",
    "TierSnapshot",
    "TieringManager",
    "TransferJob",
    "UnsafeEntryError",
    "__version__",
    "chain_ids",
    "chain_key",
    "prefix_keys",
    "register_tier",
    "root_key",
    "tier_label",
]
