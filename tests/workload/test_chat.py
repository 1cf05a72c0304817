"""The deterministic multi-turn chat workload."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.workload.chat import ChatWorkloadSpec, generate_chat, workload_summary


def test_same_seed_same_requests_other_seed_differs() -> None:
    a = generate_chat(ChatWorkloadSpec(sessions=8, seed=3))
    b = generate_chat(ChatWorkloadSpec(sessions=8, seed=3))
    c = generate_chat(ChatWorkloadSpec(sessions=8, seed=4))
    assert [r.req_id for r in a] == [r.req_id for r in b]
    assert all(np.array_equal(x.token_ids, y.token_ids) for x, y in zip(a, b, strict=True))
    assert not all(
        len(x.token_ids) == len(y.token_ids) and np.array_equal(x.token_ids, y.token_ids)
        for x, y in zip(a, c, strict=False)
    )


def test_sessions_return_with_growing_prefix() -> None:
    reqs = generate_chat(ChatWorkloadSpec(sessions=6, min_turns=3, max_turns=3))
    by_session: dict[int, list] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        assert [t.turn for t in turns] == [0, 1, 2]
        for prev, cur in itertools.pairwise(turns):
            assert len(cur.token_ids) > len(prev.token_ids) + prev.output_tokens
            assert np.array_equal(cur.token_ids[: len(prev.token_ids)], prev.token_ids)
            assert cur.arrival_s >= prev.arrival_s


def test_arrival_order_and_shared_system_prompts() -> None:
    spec = ChatWorkloadSpec(sessions=40, shared_system_prompts=2, shared_fraction=1.0)
    reqs = generate_chat(spec)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    firsts = [r for r in reqs if r.turn == 0]
    assert {r.system_prompt for r in firsts} == {0, 1}
    same = [r for r in firsts if r.system_prompt == 0]
    n = spec.system_tokens[0]
    assert all(np.array_equal(r.token_ids[:n], same[0].token_ids[:n]) for r in same)
    summary = workload_summary(reqs, 16)
    assert summary["distinct_blocks"] < summary["block_refs"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sessions": 0},
        {"min_turns": 3, "max_turns": 2},
        {"shared_fraction": 1.5},
        {"user_tokens": (0, 5)},
        {"vocab_size": 1},
    ],
)
def test_invalid_specs(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        ChatWorkloadSpec(**kwargs)
