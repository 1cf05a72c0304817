"""kvtier: tiered KV-cache offloading for LLM inference engines.

The public API, re-exported; see the README for a quickstart.
"""

from kvtier.errors import (
    ConfigError,
    CorruptValueError,
    InsufficientSpaceError,
    InvalidKeyError,
    KvtierError,
    ManagerClosedError,
    RegionBusyError,
    RegionError,
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
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob
from kvtier.tiers.registry import register_tier
from kvtier.types import BlockEvent, LookupResult, OffloadPolicy, RequestContext
from kvtier.version import __version__

__all__ = [
    "BlockEvent",
    "BlockKey",
    "ConfigError",
    "CorruptValueError",
    "InsufficientSpaceError",
    "InvalidKeyError",
    "JobResult",
    "KVGeometry",
    "KvtierError",
    "LookupResult",
    "ManagerClosedError",
    "Namespace",
    "OffloadPolicy",
    "PrepareStoreResult",
    "PrimaryTier",
    "RegionBusyError",
    "RegionError",
    "RequestContext",
    "SecondaryTier",
    "SharedRegion",
    "TierContext",
    "TierError",
    "TierFailure",
    "TierShutdownError",
    "TierShutdownTimeout",
    "TieringManager",
    "TransferJob",
    "UnsafeEntryError",
    "__version__",
    "chain_ids",
    "chain_key",
    "prefix_keys",
    "register_tier",
    "root_key",
]
