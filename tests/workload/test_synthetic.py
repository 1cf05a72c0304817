"""Generated workloads: deterministic, well-formed block traces with each kind's reuse pattern."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from kvtier.errors import ConfigError
from kvtier.workload.simulate import unbounded_hit_rate
from kvtier.workload.synthetic import KINDS, generate
from kvtier.workload.trace import TRACE_BLOCK_TOKENS, FlatTrace, TraceRequest


def prefixes_are_consistent(requests: list[TraceRequest]) -> None:
    """Equal ids mean equal prefixes: a block id always follows the same parent id."""
    parent_of: dict[int, int] = {}
    for req in requests:
        up = -1
        for block in req.hash_ids:
            assert parent_of.setdefault(block, up) == up, f"block {block} follows two different prefixes"
            up = block


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_deterministic_and_well_formed(kind: str) -> None:
    requests = generate(kind, 1500, seed=7)
    assert len(requests) == 1500
    assert requests == generate(kind, 1500, seed=7)
    assert requests != generate(kind, 1500, seed=8)
    times = [r.timestamp_ms for r in requests]
    assert times == sorted(times)
    prefixes_are_consistent(requests)
    counts = Counter(b for r in requests for b in set(r.hash_ids))
    assert all(counts[r.hash_ids[-1]] == 1 for r in requests), "the partial last block is never reused"
    for r in requests:
        assert len(r.hash_ids) >= 2
        assert (len(r.hash_ids) - 1) * TRACE_BLOCK_TOKENS < r.input_length <= len(r.hash_ids) * TRACE_BLOCK_TOKENS
    reuse = unbounded_hit_rate(FlatTrace.from_requests(requests)).hit_rate
    assert 0.2 < reuse < 0.95, f"{kind}: unbounded hit rate {reuse:.2f}"


def test_a_prefix_of_the_requests_is_the_same_for_any_count() -> None:
    assert generate("mix", 300, seed=1) == generate("mix", 900, seed=1)[:300]


def test_chat_sessions_resend_their_history_and_have_heavy_tailed_lengths() -> None:
    requests = generate("chat", 4000, seed=2)
    by_first_new: Counter[int] = Counter()
    for r in requests:
        by_first_new[r.hash_ids[min(4, len(r.hash_ids) - 2)]] += 1
    turns = sorted(by_first_new.values(), reverse=True)
    assert turns[0] >= 15, "a few sessions go on for many turns"
    assert sum(1 for t in turns if t <= 2) > len(turns) / 2, "most sessions are short"


def test_agentic_steps_extend_the_previous_step() -> None:
    requests = generate("agentic", 400, seed=3)
    extended = 0
    seen: set[tuple[int, ...]] = set()
    for r in requests:
        full = r.hash_ids[:-1]
        extended += any(full[:n] in seen for n in range(len(full) - 1, 6, -1))
        seen.add(full)
    assert extended > 0.7 * len(requests)


def test_rag_and_api_share_popular_prefixes_and_shift_moves_them() -> None:
    for kind in ("rag", "api"):
        requests = generate(kind, 3000, seed=4)
        heads = Counter(r.hash_ids[3] for r in requests if len(r.hash_ids) > 4)
        top = heads.most_common(1)[0][1]
        assert top > 0.05 * len(requests), f"{kind}: no popular prefix"
    requests = generate("shift", 3000, seed=4)
    thirds = [requests[:900], requests[1050:1950], requests[-900:]]
    tops = [Counter(r.hash_ids[3] for r in part if len(r.hash_ids) > 4).most_common(1)[0][0] for part in thirds]
    assert len(set(tops)) == 3, "the most popular document changes twice"


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown synthetic workload 'video'"):
        generate("video")
    with pytest.raises(ConfigError, match="positive"):
        generate("chat", 0)


def test_docqa_asks_short_questions_about_long_shared_documents() -> None:
    requests = generate("docqa", 2000, seed=5)
    seen: set[tuple[int, ...]] = set()
    shared = 0
    for r in requests:
        document = r.hash_ids[:-2]  # all but the question and the partial block
        assert len(document) >= 18, "system prompt and a document of 16 blocks at least"
        shared += document in seen
        seen.add(document)
    assert shared > 0.7 * len(requests), "most questions are about a document asked about before"


def test_code_sessions_resend_a_growing_file_and_edit_it_higher_up() -> None:
    requests = generate("code", 3000, seed=6)
    by_head: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for r in requests:
        by_head.setdefault(r.hash_ids[:1], []).append(r.hash_ids[:-1])
    grew = edited = 0
    for prompts in by_head.values():
        for before, after in itertools.pairwise(prompts):
            pairs = enumerate(zip(before, after, strict=False))
            common = next((i for i, (a, b) in pairs if a != b), min(len(before), len(after)))
            if common == len(before) and len(after) > len(before):
                grew += 1
            elif common < len(before):
                edited += 1
    assert grew > 0 and edited > 0
    reuse = unbounded_hit_rate(FlatTrace.from_requests(requests)).hit_rate
    assert reuse > 0.8, "completions re-send nearly all of their prefix"


def test_bursty_floods_the_cache_with_one_off_documents_in_bursts() -> None:
    requests = generate("bursty", 6000, seed=7)
    instruction = Counter(r.hash_ids[0] for r in requests if len(r.hash_ids) >= 12).most_common(1)[0][0]
    batch = [r.timestamp_ms for r in requests if r.hash_ids[0] == instruction and len(r.hash_ids) >= 12]
    gaps = sorted(b - a for a, b in itertools.pairwise(batch))
    assert len(batch) > 500
    assert gaps[len(gaps) // 2] < 1000 and gaps[-1] > 60_000, "dense bursts, long quiet spells between them"
