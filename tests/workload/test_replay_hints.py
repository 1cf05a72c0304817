"""Replay with application hints: generated sessions carry them, --hints feeds them, off changes nothing."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvtier.workload.replay import replay_manager, replay_namespace, trace_keys
from kvtier.workload.synthetic import KINDS, generate, generate_with_hints
from kvtier.workload.trace import FlatTrace


@pytest.mark.parametrize("kind", KINDS)
def test_hints_come_with_the_same_requests_and_tell_the_truth_about_sessions(kind: str) -> None:
    requests, hints = generate_with_hints(kind, 400, seed=3)
    assert requests == generate(kind, 400, seed=3), "hints must not change the workload"
    assert len(hints) == len(requests)
    by_session: dict[str, list[int]] = {}
    for i, params in enumerate(hints):
        if params is not None:
            by_session.setdefault(str(params["kvtier_session"]), []).append(i)
    if kind in ("rag", "api", "shift"):
        assert not by_session, "no sessions in single-turn kinds"
        return
    assert by_session
    for turns in by_session.values():
        for here, after in itertools.pairwise(turns):
            params = hints[here]
            assert params is not None and params["kvtier_session_end"] is False
            gap = (requests[after].timestamp_ms - requests[here].timestamp_ms) / 1000
            assert params["kvtier_expected_return_s"] == gap
            assert requests[after].hash_ids[0] == requests[here].hash_ids[0], "a session keeps its prefix"
            if kind in ("chat", "agentic"):  # the next turn re-sends the conversation: it extends this one
                assert requests[after].hash_ids[: len(requests[here].hash_ids) - 1] == requests[here].hash_ids[:-1]
        last = hints[turns[-1]]
        assert last is not None and "kvtier_expected_return_s" not in last


def test_replay_feeds_hints_to_return_time_and_lru_ignores_them(private_shm: Path) -> None:
    requests, hints = generate_with_hints("chat", 1500, seed=0)
    ns = replay_namespace()
    keys = trace_keys(FlatTrace.from_requests(requests), ns)
    cap = 120
    run = {
        (policy, given is not None): replay_manager(
            keys, cap, policy=policy, namespace=ns, shm_dir=str(private_shm), params=given, store_chunk=16
        )
        for policy in ("lru", "return-time")
        for given in (None, hints)
    }
    assert run["lru", True].hits == run["lru", False].hits
    hinted = run["return-time", True]
    assert hinted.extra["policy_hinted_ended"] > 0 and hinted.extra["policy_hinted_held"] > 0
    assert run["return-time", False].extra["policy_hinted_held"] == 0
    # The hints are worth something on chat (1.3x LRU at 5 % of 2,000 requests, seeds 0-2).
    assert hinted.hit_rate > 1.1 * run["lru", False].hit_rate
    assert hinted.extra["self_evictions"] == 0


def test_the_cli_replays_with_hints_and_refuses_them_for_a_trace(
    capsys: pytest.CaptureFixture[str], private_shm: Path, tmp_path: Path
) -> None:
    from kvtier.cli import main

    out = tmp_path / "hints.json"
    args = ["replay", "--synthetic", "agentic", "--requests", "400", "--capacity", "5%", "--policy", "return-time",
            "--no-belady", "--no-progress", "--shm-dir", str(private_shm)]  # fmt: skip
    assert main([*args, "--hints", "--json", str(out)]) == 0
    assert "synthetic agentic (seed 0), hints" in capsys.readouterr().out
    document = json.loads(out.read_text())
    assert document["hints"] is True
    policies = document["rows"][0]["policies"]
    assert policies["return-time"]["policy_hinted_ended"] + policies["return-time"]["policy_hinted_held"] > 0
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n')
    assert main(["replay", str(trace), "--hints", "--capacity", "4", "--shm-dir", str(private_shm)]) == 2
    assert "--hints feeds the sessions of a generated workload (--synthetic KIND)" in capsys.readouterr().err
