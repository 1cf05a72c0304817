"""Small synthetic block traces for the workload tests."""

from __future__ import annotations

import numpy as np

from kvtier.workload.trace import FlatTrace, TraceRequest


def flat(*requests: list[int]) -> FlatTrace:
    return FlatTrace.from_requests([TraceRequest(i, 0, 0, tuple(r)) for i, r in enumerate(requests)])


def random_chat_trace(seed: int, n_requests: int = 300) -> FlatTrace:
    """Chained ids: sessions grow their prefix; a few shared roots."""
    rng = np.random.default_rng(seed)
    sessions: list[list[int]] = []
    next_id = 100
    reqs = []
    for _ in range(n_requests):
        if sessions and rng.random() < 0.6:
            s = sessions[int(rng.integers(len(sessions)))]
        else:
            s = [int(rng.integers(0, 5))]
            sessions.append(s)
        for _ in range(int(rng.integers(1, 4))):
            s.append(next_id)
            next_id += 1
        reqs.append(list(s))
    return flat(*reqs)
