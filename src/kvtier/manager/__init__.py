"""The scheduler-side orchestrator: :class:`TieringManager` and the rooms it is built from.

Importers use this package (``from kvtier.manager import TieringManager``). Its rooms:

* :mod:`~kvtier.manager.core`: ``TieringManager`` itself: the scheduler API, the
  step contract, the lookup hot path and the cascade decisions;
* :mod:`~kvtier.manager.handle`: one ``TierHandle`` per secondary tier (its index,
  context, descriptor, telemetry, admission, RETRY state, liveness, guarded calls);
* :mod:`~kvtier.manager.tierset`: the ``TierSet`` of them: the lookup after a CPU
  miss, broadcasts, and the shutdown that shares a deadline;
* :mod:`~kvtier.manager.admission`: whether a tier takes a cascade (backpressure;
  the seam a learned admission plugs into);
* :mod:`~kvtier.manager.ledger`: tier jobs, submitted with one unwind path, polled,
  finished, drained;
* :mod:`~kvtier.manager.requests`: the request table and per-request control;
* :mod:`~kvtier.manager.snapshot`: the typed snapshot, built by pure functions;
* :mod:`~kvtier.manager.scan`: the CPU-hit run of a prefix scan, in C-level passes;
* :mod:`~kvtier.manager.build`: the steps of ``TieringManager.create``.

Only ``core`` knows the others; they never import it.
"""

from kvtier.manager.core import TieringManager

__all__ = ["TieringManager"]
