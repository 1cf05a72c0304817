"""Worker-side copies between a device KV pool and rows of the shared CPU region.

A copy job is planned once (:mod:`kvtier.transfer.plan`, built from block
layouts, :mod:`kvtier.transfer.pieces`, paired in :mod:`kvtier.transfer.layout`) and executed by the best available
backend (:mod:`kvtier.transfer.backends`) on a
:class:`~kvtier.transfer.engine.TransferEngine`.
"""

from kvtier.transfer.backends import CopyBackend, HostCopyBackend, TorchCopyBackend
from kvtier.transfer.engine import CopyPair, TransferEngine, TransferResult, Work, as_plan, copy_blocks
from kvtier.transfer.layout import BlockCopyPlan, BlockMapping, MappedBlocks
from kvtier.transfer.pieces import BlockPieces, join_adjacent
from kvtier.transfer.plan import ByteSpace, CopyBatch, CopyPlan, StridedRuns, aligned_host_array, byte_space

__all__ = [
    "BlockCopyPlan",
    "BlockMapping",
    "BlockPieces",
    "ByteSpace",
    "CopyBackend",
    "CopyBatch",
    "CopyPair",
    "CopyPlan",
    "HostCopyBackend",
    "MappedBlocks",
    "StridedRuns",
    "TorchCopyBackend",
    "TransferEngine",
    "TransferResult",
    "Work",
    "aligned_host_array",
    "as_plan",
    "byte_space",
    "copy_blocks",
    "join_adjacent",
]
