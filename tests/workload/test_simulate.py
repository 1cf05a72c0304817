"""Reference hit rates: unbounded, LRU and Belady, on hand-checked and random traces."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from workload_helpers import flat, random_chat_trace

from kvtier.errors import ConfigError
from kvtier.workload.simulate import belady_hit_rate, lru_hit_rate, next_use, unbounded_hit_rate
from kvtier.workload.trace import FlatTrace, read_trace

REAL_TRACE = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "conversation_trace.jsonl"


def test_prefix_rule_counts_only_leading_hits() -> None:
    trace = flat([1, 2, 3], [1, 9, 3], [1, 2, 3])
    # Request 2: 1 hits, 9 misses, so 3 is no hit although cached.
    assert unbounded_hit_rate(trace).hits == 1 + 3
    assert lru_hit_rate(trace, 10).hits == 4


def test_lru_evicts_least_recent() -> None:
    trace = flat([1], [2], [3], [1], [2])
    assert lru_hit_rate(trace, 2).hits == 0  # cyclic access defeats LRU of 2
    assert lru_hit_rate(trace, 3).hits == 2


def test_belady_beats_lru_on_a_cycle() -> None:
    trace = flat([1], [2], [3], [1], [2], [3], [1])
    assert lru_hit_rate(trace, 2).hits == 0
    assert belady_hit_rate(trace, 2).hits == 3
    assert belady_hit_rate(trace, 2, bypass=False).hits == 2  # MIN must admit 3 at first


def test_belady_bypass_keeps_better_blocks() -> None:
    # With bypass the one-off block 9 never displaces 1.
    trace = flat([1], [9], [1])
    assert belady_hit_rate(trace, 1).hits == 1
    assert belady_hit_rate(trace, 1, bypass=False).hits == 0


def test_next_use_matches_brute_force() -> None:
    ids = np.random.default_rng(1).integers(0, 20, size=500)
    got = next_use(ids)
    for i in range(len(ids)):
        later = [j for j in range(i + 1, len(ids)) if ids[j] == ids[i]]
        assert got[i] == (later[0] if later else len(ids))


def _brute_lru(trace: FlatTrace, cap: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for r in range(trace.num_requests):
        prefix = True
        for b in trace.request(r).tolist():
            if b in cache and prefix:
                hits += 1
            elif b not in cache:
                prefix = False
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
                if len(cache) > cap:
                    cache.popitem(last=False)
    return hits


@pytest.mark.parametrize("seed", range(5))
def test_orderings_on_random_traces(seed: int) -> None:
    trace = random_chat_trace(seed)
    unbounded = unbounded_hit_rate(trace).hits
    for cap in (5, 20, 80):
        lru = lru_hit_rate(trace, cap).hits
        belady = belady_hit_rate(trace, cap).hits
        assert lru == _brute_lru(trace, cap)
        assert lru <= belady <= unbounded
        assert belady_hit_rate(trace, cap, bypass=False).hits <= belady


def test_belady_reaches_unbounded_when_live_set_fits() -> None:
    trace = random_chat_trace(7)
    nu = next_use(trace.ids)
    n = len(nu)
    delta = np.zeros(n + 1, dtype=np.int64)
    live = nu < n
    np.add.at(delta, np.arange(n)[live], 1)
    np.add.at(delta, nu[live], -1)
    max_live = int(np.cumsum(delta).max())
    assert belady_hit_rate(trace, max_live + 1).hits == unbounded_hit_rate(trace).hits


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="positive"):
        lru_hit_rate(flat([1]), 0)
    with pytest.raises(ConfigError, match="positive"):
        belady_hit_rate(flat([1]), -1)


@pytest.mark.skipif(not REAL_TRACE.is_file(), reason="shared Mooncake trace not present")
def test_real_trace_reference_numbers() -> None:
    trace = FlatTrace.from_requests(read_trace(REAL_TRACE))
    assert unbounded_hit_rate(trace).hit_rate == pytest.approx(0.366, abs=0.001)
    lru = lru_hit_rate(trace, 9139).hit_rate
    assert lru == pytest.approx(0.195, abs=0.005)
    belady = belady_hit_rate(trace, 9139).hit_rate
    assert belady >= lru
    assert belady <= unbounded_hit_rate(trace).hit_rate + 1e-12
