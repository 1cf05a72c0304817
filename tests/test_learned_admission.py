"""``admission: learned`` (issue 21, item 4): a tier option every tier takes, validated once,
never passed to the tier; the manager's learned cascade admission writes to the tier only
the stores the CPU tier's policy predicts are worth it, and counts what it admitted and
declined (snapshot and metrics)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier import Namespace, RequestContext, TieringManager, prefix_keys
from kvtier.config import load_config
from kvtier.config.build import describe_config
from kvtier.errors import ConfigError
from kvtier.keys import KVGeometry
from kvtier.manager.admission import SESSIONS_SEEN, LearnedAdmission
from kvtier.metrics import KvtierMetrics
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.registry import register_tier, validate_tier_options
from request_flow import serve
from tier_doubles import ScriptedTier

pytestmark = pytest.mark.usefixtures("shm_leak_check")
register_tier("scripted", "tier_doubles:ScriptedTier")

SMALL = Namespace("admission-test", KVGeometry.from_block_bytes(64, tokens_per_block=16))


def test_the_option_is_validated_for_every_tier_and_names_the_fix() -> None:
    assert validate_tier_options({"type": "memory", "admission": "learned"})["admission"] == "learned"
    assert "admission" not in validate_tier_options({"type": "memory"})  # left out: the default
    # A tier checked by its constructor's signature (no options model) takes it too.
    assert validate_tier_options({"type": "scripted", "admission": "all"})["admission"] == "all"
    for bad in ("sometimes", 1, None, ["learned"]):
        with pytest.raises(ConfigError, match="admission") as err:
            validate_tier_options({"type": "memory", "admission": bad})
        assert "learned" in str(err.value)  # names what it takes
    config = load_config(cli={"tiers": [{"type": "memory", "admission": "learned"}]})
    assert config.tiers[0]["admission"] == "learned"


def test_the_tier_never_receives_the_option_its_context_carries_it() -> None:
    tiers = [{"type": "memory", "admission": "learned"}, {"type": "scripted"}]
    mgr = TieringManager.create(namespace=SMALL, num_cpu_blocks=64, tiers=tiers)
    try:
        memory, scripted = mgr.tiers
        assert isinstance(memory, MemoryTier) and isinstance(scripted, ScriptedTier)
        assert memory.context.admission == "learned" and scripted.context.admission == "all"
        assert "admission" not in memory.options.model_fields_set
        assert isinstance(mgr._tiers.handles[0].admission, LearnedAdmission)
        snap = mgr.stats()
        assert snap.tier("1:memory").admission is not None
        assert snap.tier("1:memory").admission.rule == "learned"
        assert snap.tier("2:scripted").admission.rule == "all"
    finally:
        mgr.shutdown()


def _finish(mgr: TieringManager, request: RequestContext) -> None:
    """End ``request`` and its step, then run steps until every cascade was reported."""
    mgr.on_request_finished(request)
    mgr.on_schedule_end()
    while mgr.has_pending_work():
        time.sleep(0.0002)
        mgr.on_schedule_end()


def _run(policy: str, rounds: int = 50) -> tuple[TieringManager, MemoryTier, list[list[bytes]]]:
    """Conversations that come back (2 new blocks a turn) beside one-off documents (24 new blocks,
    never seen again), through a 256-block CPU tier and a learned memory tier. Returns the manager
    (running) and the documents' keys of the last rounds."""
    tier_blocks = 4096
    spec = {"type": "memory", "admission": "learned", "max_bytes": tier_blocks * MemoryTier.bytes_per_block(64)}
    mgr = TieringManager.create(namespace=SMALL, num_cpu_blocks=256, policy=policy, tiers=[spec])
    rng = np.random.default_rng(0)
    sessions = [[int(x) for x in rng.integers(0, 2**31, 4)] for _ in range(24)]
    late_docs: list[list[bytes]] = []
    n = 0
    for r in range(rounds):
        for s in range(len(sessions)):
            sessions[s] += [int(x) for x in rng.integers(0, 2**31, 2)]
            doc = [int(x) for x in rng.integers(0, 2**31, 24)]
            for ids in (sessions[s], doc):
                keys = prefix_keys(np.asarray(ids), 1)
                serve(mgr, RequestContext(f"r{n}"), keys)
                n += 1
                if ids is doc and r >= rounds - 10:
                    late_docs.append(keys)
            if len(sessions[s]) > 40:
                sessions[s] = [int(x) for x in rng.integers(0, 2**31, 4)]  # a new conversation
    tier = mgr.tiers[0]
    assert isinstance(tier, MemoryTier)
    return mgr, tier, late_docs


@pytest.mark.slow
def test_learned_admission_declines_what_the_policy_predicts_will_not_return() -> None:
    mgr, tier, late_docs = _run("return-time")
    try:
        snap = mgr.stats()
        admission = snap.tier("1:memory").admission
        assert admission is not None and admission.rule == "learned"
        assert admission.learned_declined > 0
        assert admission.declined_blocks == admission.learned_declined  # no backpressure here
        # What it declined were the documents, which never return: once learned, none is written.
        written_docs = sum(1 for keys in late_docs if any(k in tier._values for k in keys))
        assert written_docs == 0
        # The conversations, which return, are still written and read back from the tier.
        assert admission.admitted_blocks > 0 and snap.tier("1:memory").lookups.hit > 0
        assert snap.tier("1:memory").written.blocks == admission.admitted_blocks
        # Its measured guard agrees: the declined documents never came back, nothing was lost.
        assert admission.guard in ("learning", "judging") and admission.guard_fallbacks == 0
        assert admission.hits_lost == 0 and admission.overridden_blocks == 0
        metrics = KvtierMetrics()
        metrics.update(snap)
        text = metrics.render().decode()
        assert (
            f'kvtier_admission_blocks_total{{decision="declined_learned",rule="learned",tier="1:memory"}} '
            f"{float(admission.learned_declined)}"
        ) in text
    finally:
        mgr.shutdown()


def test_a_policy_that_predicts_nothing_admits_everything() -> None:
    mgr, _, _ = _run("lru", rounds=3)
    try:
        admission = mgr.stats().tier("1:memory").admission
        assert admission is not None and admission.declined_blocks == 0 and admission.admitted_blocks > 0
    finally:
        mgr.shutdown()


def test_replay_reports_what_each_tier_was_given(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    args = ["replay", "--synthetic", "docqa", "--requests", "300", "--capacity", "2%", "--no-belady",
            "--fs-root", str(tmp_path / "fs"), "--fs-blocks", "10%", "--admission", "learned", "--json", str(out)]
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    kv = json.loads(out.read_text())["rows"][0]["kvtier"]
    assert kv["written_bytes:1:fs"] > 0
    assert kv["admitted_blocks:1:fs"] + kv["declined_blocks:1:fs"] > 0
    assert {"hits_gained:1:fs", "hits_lost:1:fs", "guard_fallbacks:1:fs", "guard_fallen_back:1:fs",
            "overridden_blocks:1:fs"} <= set(kv)  # fmt: skip
    assert "1:fs: " in done.stdout and "blocks admitted" in " ".join(done.stdout.split())
    # The fs tier's size and admission need the fs tier: said, not ignored.
    bad_args = ["replay", "--synthetic", "chat", "--admission", "learned"]
    bad = subprocess.run([sys.executable, "-m", "kvtier.cli", *bad_args], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--admission" in bad.stderr and "--fs-root" in bad.stderr


def test_config_show_sizes_a_tier_that_names_its_admission() -> None:
    """Regression: the tier's capacity was computed from options that still held ``admission``,
    which the tier's own model refuses."""
    config = load_config(cli={"tiers": [{"type": "memory", "max_bytes": "1MiB", "admission": "learned"}]})
    tier = describe_config(config)["tiers"][0]
    assert tier["capacity_bytes"] == 1 << 20 and tier["options"]["admission"] == "learned"


class _Predictions:
    """The CPU tier as the admission sees it (a collaborator): slots by key, and a policy whose
    predictions the test sets."""

    def __init__(self) -> None:
        self.ratio = 1.0
        self.policy = self
        self.asked = 0

    def slot_of(self, key: bytes) -> int:
        return 0

    def relative_reuse(self, tail_slot: int, horizon: int) -> float:
        self.asked += 1
        return self.ratio


def test_a_request_stored_in_pieces_follows_its_first_stores_decision() -> None:
    """Regression: each piece was judged alone, so a request's later pieces (more new blocks, a
    class that returns less) were declined after its first were written, leaving them useless in
    the tier (api seed 0, one block a store: 0.71x the hit rate of admitting all)."""
    cpu = _Predictions()
    admission = LearnedAdmission(cpu, 1000, None)  # type: ignore[arg-type]
    keys = prefix_keys(np.arange(4), 1)
    first, other = RequestContext("first"), RequestContext("other")
    assert admission.admit(keys[:1], first, 0)
    cpu.ratio = 0.1  # its later pieces look like a class that seldom returns
    assert all(admission.admit(keys[i : i + 1], first, 0) for i in range(1, 4))
    assert not admission.admit(keys, other, 0) and admission.declined == 4
    cpu.ratio = 1.0
    assert not admission.admit(keys, other, 0)  # declined from its first store on: no holes
    assert admission.admit(keys, None, 0)  # a store without a request is judged alone
    assert cpu.asked == 3


def test_the_last_request_of_a_conversation_is_not_written() -> None:
    """``kvtier_session_end`` on a conversation that stored here before: the request's new blocks
    are the conversation's own last turn; a learned tier is not given them whatever the policy
    predicts, and its later pieces follow. A conversation's only request (it may carry a shared
    document) and a conversation forgotten or never seen are judged by the policy."""
    cpu = _Predictions()
    admission = LearnedAdmission(cpu, 1000, None)  # type: ignore[arg-type]
    manager = TieringManager.create(namespace=SMALL, num_cpu_blocks=8)

    def request(name: str, **params: object) -> RequestContext:
        made = RequestContext(name, params=params)
        manager.request_control(made)  # parsed as complete_store parses it before a cascade
        return made

    keys = prefix_keys(np.arange(4), 1)
    try:
        assert admission.admit(keys, request("c1-t0", kvtier_session="c1"), 0)
        assert admission.admit(keys, request("c1-t1", kvtier_session="c1", kvtier_session_end=False), 0)
        asked = cpu.asked
        last = request("c1-t2", kvtier_session="c1", kvtier_session_end=True)
        assert not admission.admit(keys[:2], last, 0) and not admission.admit(keys[2:], last, 0)
        assert admission.declined == 4 and cpu.asked == asked
        # The conversation is forgotten once it ended: a request reusing its id is judged again.
        assert admission.admit(keys, request("c1-again", kvtier_session="c1", kvtier_session_end=True), 0)
        # A conversation of one request, one never seen here, a session_end without a session id,
        # no hints, hints not parsed (a request the manager never saw): judged by the policy.
        assert admission.admit(keys, request("only", kvtier_session="c2", kvtier_session_end=True), 0)
        assert admission.admit(keys, request("no-id", kvtier_session_end=True), 0)
        assert admission.admit(keys, request("no-hints"), 0)
        assert admission.admit(keys, RequestContext("raw", params={"kvtier_session_end": True}), 0)
        assert admission.declined == 4
        cpu.ratio = 0.1  # the policy still declines what it predicts will not return
        assert not admission.admit(keys, request("c3-t0", kvtier_session="c3"), 0)
    finally:
        manager.shutdown()


def test_the_conversations_remembered_are_bounded() -> None:
    cpu = _Predictions()
    admission = LearnedAdmission(cpu, 1000, None)  # type: ignore[arg-type]
    manager = TieringManager.create(namespace=SMALL, num_cpu_blocks=8)
    keys = prefix_keys(np.arange(2), 1)
    try:
        for i in range(SESSIONS_SEEN + 10):
            first = RequestContext(f"s{i}", params={"kvtier_session": f"conversation-{i}"})
            manager.request_control(first)
            assert admission.admit(keys, first, 0)
        assert len(admission._sessions) == SESSIONS_SEEN
        oldest = RequestContext("end-0", params={"kvtier_session": "conversation-0", "kvtier_session_end": True})
        newest = RequestContext(
            "end-n", params={"kvtier_session": f"conversation-{SESSIONS_SEEN + 9}", "kvtier_session_end": True}
        )
        for r in (oldest, newest):
            manager.request_control(r)
        assert admission.admit(keys, oldest, 0)  # forgotten: judged by the policy
        assert not admission.admit(keys, newest, 0)
    finally:
        manager.shutdown()


def test_session_end_hints_spare_a_learned_tier_through_the_manager() -> None:
    """End to end: conversations of 2-block turns whose last turn says it ends them; the learned
    tier is given none of the last turns' blocks, an ``all`` tier beside it every block."""
    block = MemoryTier.bytes_per_block(64)
    specs = [{"type": "memory", "admission": "learned", "max_bytes": 512 * block},
             {"type": "memory", "max_bytes": 512 * block}]  # fmt: skip
    mgr = TieringManager.create(namespace=SMALL, num_cpu_blocks=64, policy="lru", tiers=specs)
    rng = np.random.default_rng(7)
    last_turns: list[list[bytes]] = []
    try:
        for c in range(12):
            ids = [int(x) for x in rng.integers(0, 2**31, 2)]
            for turn in range(4):
                if turn:
                    ids += [int(x) for x in rng.integers(0, 2**31, 2)]
                params = {"kvtier_session": f"c{c}", "kvtier_session_end": turn == 3}
                request = RequestContext(f"c{c}-t{turn}", params=params)
                mgr.on_new_request(request)
                keys = prefix_keys(np.asarray(ids), 1)
                new = keys[-2:] if turn else keys
                result = mgr.prepare_store(new, request)
                assert result is not None
                mgr.complete_store(result.keys_to_store, request)
                _finish(mgr, request)
                if turn == 3:
                    last_turns.append(keys[-2:])
        learned, everything = mgr.tiers
        assert isinstance(learned, MemoryTier) and isinstance(everything, MemoryTier)
        assert not any(k in learned._values for keys in last_turns for k in keys)
        assert all(k in everything._values for keys in last_turns for k in keys)
        admission = mgr.stats().tier("1:memory").admission
        assert admission is not None and admission.learned_declined == 2 * len(last_turns)
        assert admission.admitted_blocks == 12 * (2 + 2 + 2)
    finally:
        mgr.shutdown()
