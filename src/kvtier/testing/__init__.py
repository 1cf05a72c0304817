"""Test support for code built on kvtier: the conformance suite every secondary tier must pass.

Needs pytest (``pip install 'kvtier[test]'``); nothing in kvtier imports this
package. See :mod:`kvtier.testing.conformance`::

    from kvtier.testing import TierConformance, TierHarness
"""

from kvtier.testing.conformance import (
    SCHEDULER_CALL_LIMIT,
    AlignedRows,
    TierConformance,
    TierFactory,
    TierHarness,
    make_namespace,
    new_job,
    resolve,
    run_job,
    wait_for,
    wait_results,
)

__all__ = [
    "SCHEDULER_CALL_LIMIT",
    "AlignedRows",
    "TierConformance",
    "TierFactory",
    "TierHarness",
    "make_namespace",
    "new_job",
    "resolve",
    "run_job",
    "wait_for",
    "wait_results",
]
