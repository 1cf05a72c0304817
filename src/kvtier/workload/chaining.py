"""Check that a trace's ``hash_ids`` are prefix-chained, as every replay figure assumes.

In a Mooncake trace equal ids mean equal prefixes up to and including that block:
an id then always follows the same id (its parent), or always opens a request. A
replay chains each request's ids into block keys (:func:`kvtier.keys.chain_ids`),
so ids that are not chained this way (content hashes of single blocks, ids reused
across unrelated prompts) are counted as different blocks by the manager but as
the same block by the Belady and unbounded references, and no figure means what
it says. :func:`check_chaining` counts the breaks; the CLI warns with the counts.

Pure functions on a :class:`~kvtier.workload.trace.FlatTrace`; any thread.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from kvtier.workload.trace import FlatTrace


@dataclass(frozen=True)
class ChainingReport:
    """What breaks prefix chaining in a trace (all zero for a well-formed trace).

    ``multi_parent_ids``: distinct ids seen under more than one parent (a request's
    first block has "no parent", so an id that opens one request and follows a
    block in another counts too); ``multi_parent_refs``: references to those ids;
    ``repeating_requests``: requests in which some id occurs more than once (a
    block cannot be its own prefix).
    """

    multi_parent_ids: int
    multi_parent_refs: int
    repeating_requests: int
    distinct_ids: int
    block_refs: int

    @property
    def chained(self) -> bool:
        return not (self.multi_parent_ids or self.repeating_requests)

    def to_dict(self) -> dict[str, int | bool]:
        return {**asdict(self), "chained": self.chained}

    def warning(self) -> str | None:
        """One line naming the counts, or None when the trace is chained."""
        if self.chained:
            return None
        parts = []
        if self.multi_parent_ids:
            parts.append(
                f"{self.multi_parent_ids} of {self.distinct_ids} distinct hash_ids appear under more than one "
                f"parent ({self.multi_parent_refs} of {self.block_refs} block references)"
            )
        if self.repeating_requests:
            parts.append(f"{self.repeating_requests} requests repeat a hash_id")
        return (
            "hash_ids are not prefix-chained: "
            + "; ".join(parts)
            + ". Every figure assumes equal ids mean equal prefixes up to that block (Mooncake format): "
            "the hit rates below are not reliable for this trace"
        )


def check_chaining(trace: FlatTrace) -> ChainingReport:
    """Count the ids of ``trace`` that break prefix chaining (see :class:`ChainingReport`).

    O(n log n) in the block references, vectorized (a second or so for millions).
    """
    ids = trace.ids
    n = len(ids)
    if n == 0:
        return ChainingReport(0, 0, 0, 0, 0)
    starts = trace.starts[:-1]
    opens = np.zeros(n, dtype=bool)
    opens[starts[starts < n]] = True
    parents = np.empty(n, dtype=np.int64)
    parents[0] = 0
    parents[1:] = ids[:-1]
    parents[opens] = 0  # with ``opens`` in the key, "no parent" never equals a real parent
    pairs = np.unique(np.stack([ids, parents, opens.astype(np.int64)], axis=1), axis=0)
    pair_ids, parent_counts = np.unique(pairs[:, 0], return_counts=True)
    bad = pair_ids[parent_counts > 1]
    distinct = len(np.unique(ids))
    bad_refs = int(np.isin(ids, bad).sum()) if len(bad) else 0
    # A request repeats an id when (request, id) pairs are fewer than its references.
    request_of = np.repeat(np.arange(trace.num_requests), np.diff(trace.starts))
    per_request = np.unique(np.stack([request_of, ids], axis=1), axis=0)
    distinct_in_request = np.bincount(per_request[:, 0], minlength=trace.num_requests)
    repeating = int((distinct_in_request < np.diff(trace.starts)).sum())
    return ChainingReport(len(bad), bad_refs, repeating, distinct, n)
