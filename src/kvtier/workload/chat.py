"""A deterministic multi-turn chat workload.

Sessions start with a system prompt (most of them one of a few shared prompts,
the rest a private one), then alternate user messages and assistant answers.
Every turn is one request whose prompt is the whole conversation so far, so a
session that comes back finds its previous prompt as a prefix. Sessions
interleave: each turn arrives after a think time, so between two turns of one
session other sessions push its blocks down the tiers.

Everything is derived from ``seed`` with numpy's PCG64: the same spec gives the
same requests, token for token, on every machine. Pure; any thread.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass

import numpy as np

from kvtier.errors import ConfigError

MAX_SESSIONS = 1_000_000
"""The most sessions a workload may have (memory is checked as well: see :meth:`ChatWorkloadSpec.max_tokens`)."""
MAX_TURNS = 10_000
"""The most turns per session."""
MAX_SHARED_PROMPTS = 100_000
"""The most shared system prompts."""
MAX_TOKENS_PER_MESSAGE = 1 << 20
"""The longest system prompt, user message or answer, in tokens."""
MAX_SEED = 2**63 - 1
"""The largest seed."""


@dataclass(frozen=True)
class ChatWorkloadSpec:
    """Shape of the workload. Token ranges are inclusive ``(low, high)``.

    Raises :class:`ConfigError` for counts that are not integers in their range
    (``sessions`` <= :data:`MAX_SESSIONS`, turns <= :data:`MAX_TURNS`, ...).
    """

    sessions: int = 48
    min_turns: int = 2
    max_turns: int = 6
    shared_system_prompts: int = 4
    shared_fraction: float = 0.75
    system_tokens: tuple[int, int] = (256, 1024)
    user_tokens: tuple[int, int] = (16, 192)
    answer_tokens: tuple[int, int] = (32, 256)
    mean_think_s: float = 30.0
    mean_arrival_gap_s: float = 4.0
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low, high in (("sessions", 1, MAX_SESSIONS), ("min_turns", 1, MAX_TURNS),
                                ("max_turns", 1, MAX_TURNS), ("shared_system_prompts", 0, MAX_SHARED_PROMPTS),
                                ("vocab_size", 2, 2**32), ("seed", 0, MAX_SEED)):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {str(value)[:40]}")
        if not 1 <= self.min_turns <= self.max_turns:
            raise ConfigError(f"turns must satisfy 1 <= min_turns <= max_turns, got {self.min_turns}..{self.max_turns}")
        if not 0.0 <= self.shared_fraction <= 1.0:
            raise ConfigError(f"shared_fraction must lie in [0, 1], got {self.shared_fraction}")
        for name in ("system_tokens", "user_tokens", "answer_tokens"):
            low, high = getattr(self, name)
            if not 0 < low <= high <= MAX_TOKENS_PER_MESSAGE:
                raise ConfigError(
                    f"{name} must be (low, high) with 0 < low <= high <= {MAX_TOKENS_PER_MESSAGE}, got {(low, high)}"
                )
        for name in ("mean_think_s", "mean_arrival_gap_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a finite number of seconds >= 0, got {value!r}")

    def max_tokens(self) -> int:
        """An upper bound of the prompt tokens of all requests together (every prompt at its longest).

        Turn ``t`` (from 0) re-sends the system prompt, ``t + 1`` user messages and
        ``t`` answers, so a session of ``T`` turns holds at most
        ``T*S + U*T(T+1)/2 + A*T(T-1)/2`` tokens; shared prompts add ``S`` each.
        What :func:`generate_chat` allocates is about 4 bytes per token for the
        prompts plus whatever the caller derives from them (block keys).
        """
        system, user, answer = self.system_tokens[1], self.user_tokens[1], self.answer_tokens[1]
        turns = self.max_turns
        per_session = turns * system + user * turns * (turns + 1) // 2 + answer * turns * (turns - 1) // 2
        return self.sessions * per_session + self.shared_system_prompts * system

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class ChatRequest:
    """One turn: ``token_ids`` is the full prompt (conversation so far)."""

    req_id: str
    session: int
    turn: int
    arrival_s: float
    token_ids: np.ndarray
    output_tokens: int
    system_prompt: int
    """Index of the shared system prompt, or -1 for a private one."""


def _tokens(rng: np.random.Generator, span: tuple[int, int], vocab: int) -> np.ndarray:
    n = int(rng.integers(span[0], span[1] + 1))
    return rng.integers(0, vocab, size=n, dtype=np.uint32)


def generate_chat(spec: ChatWorkloadSpec | None = None) -> list[ChatRequest]:
    """All requests of the workload in arrival order (ties broken by session)."""
    spec = spec or ChatWorkloadSpec()
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    shared = [_tokens(rng, spec.system_tokens, spec.vocab_size) for _ in range(spec.shared_system_prompts)]

    # Per session: its system prompt, turn count, start time.
    sessions: list[tuple[np.ndarray, int, int]] = []
    start = 0.0
    starts: list[float] = []
    for _ in range(spec.sessions):
        if shared and rng.random() < spec.shared_fraction:
            which = int(rng.integers(0, len(shared)))
            system = shared[which]
        else:
            which = -1
            system = _tokens(rng, spec.system_tokens, spec.vocab_size)
        turns = int(rng.integers(spec.min_turns, spec.max_turns + 1))
        sessions.append((system, turns, which))
        starts.append(start)
        start += float(rng.exponential(spec.mean_arrival_gap_s))

    # Each session's own generator keeps its content independent of interleaving.
    out: list[ChatRequest] = []
    heap: list[tuple[float, int, int]] = [(t, s, 0) for s, t in enumerate(starts)]
    heapq.heapify(heap)
    history: list[np.ndarray] = [sessions[s][0] for s in range(spec.sessions)]
    srngs = [np.random.Generator(np.random.PCG64([spec.seed, s + 1])) for s in range(spec.sessions)]
    while heap:
        arrival, s, turn = heapq.heappop(heap)
        srng = srngs[s]
        user = _tokens(srng, spec.user_tokens, spec.vocab_size)
        prompt = np.concatenate([history[s], user])
        answer = _tokens(srng, spec.answer_tokens, spec.vocab_size)
        out.append(
            ChatRequest(
                req_id=f"s{s}-t{turn}",
                session=s,
                turn=turn,
                arrival_s=arrival,
                token_ids=prompt,
                output_tokens=len(answer),
                system_prompt=sessions[s][2],
            )
        )
        history[s] = np.concatenate([prompt, answer])
        if turn + 1 < sessions[s][1]:
            heapq.heappush(heap, (arrival + float(srng.exponential(spec.mean_think_s)), s, turn + 1))
    return out


def workload_summary(requests: list[ChatRequest], tokens_per_block: int) -> dict[str, int]:
    """Requests, prompt tokens, full blocks and distinct block prefixes (by token content)."""
    blocks = 0
    distinct: set[bytes] = set()
    import hashlib

    for req in requests:
        n = len(req.token_ids) // tokens_per_block
        blocks += n
        h = hashlib.sha256()
        data = req.token_ids[: n * tokens_per_block].astype("<u4").tobytes()
        step = tokens_per_block * 4
        for i in range(n):
            h.update(data[i * step : (i + 1) * step])
            distinct.add(h.copy().digest())
    return {
        "requests": len(requests),
        "sessions": len({r.session for r in requests}),
        "prompt_tokens": int(sum(len(r.token_ids) for r in requests)),
        "block_refs": blocks,
        "distinct_blocks": len(distinct),
    }
