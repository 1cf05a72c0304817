"""Generated block traces, to check a cache policy on more than one real trace.

Each kind models one way LLM traffic reuses prefixes, at the granularity of the
Mooncake traces (one id per block of 512 tokens; equal ids mean equal
prefixes up to and including that block; a request's last block is partial,
so it gets an id of its own and is never reused):

* ``chat``: multi-turn sessions with heavy-tailed lengths (most sessions are
  short, a few go on for dozens of turns) and heavy-tailed think times; every
  turn re-sends the conversation so far plus the new message.
* ``agentic``: agent loops that re-send a growing context at short
  intervals: a task prompt, then one step per tool call, each appending the
  tool's output.
* ``rag``: retrieval-augmented questions: a shared system prompt, one to
  three documents drawn from a Zipf-popular corpus, then the question.
* ``api``: single-turn calls from many clients sharing a few long system
  prompts (with few-shot examples), Zipf-popular, plus their own input.
* ``shift``: like ``rag``, but which documents are popular changes twice.
* ``mix``: all of the above interleaved over the same span of time.
* ``docqa``: long documents (8k-48k tokens) from a Zipf-popular library, each
  asked a few short questions in a row: one long shared prefix, one block of
  question.
* ``code``: code completion in editor sessions: a repository's shared files,
  then the file being edited up to the cursor, re-sent every few seconds as
  the file grows, now and then edited higher up (the blocks after the edit
  change).
* ``bursty``: chat and API traffic at a steady rate, and bursts of a batch job
  (one shared instruction, then a long document never seen again) that flood
  the cache for a minute or two at a time.

Everything derives from ``seed`` (numpy PCG64): the same call gives the same
trace on every machine. Pure functions; any thread.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

import numpy as np

from kvtier.errors import ConfigError
from kvtier.workload.trace import TRACE_BLOCK_TOKENS, TraceRequest

KINDS = ("chat", "agentic", "rag", "api", "shift", "mix", "docqa", "code", "bursty")
"""The workloads :func:`generate` knows."""

DEFAULT_REQUESTS = 8000

MAX_REQUESTS = 10_000_000
"""The most requests :func:`generate` makes (``kvtier replay --requests`` has the same bound)."""


class _BlockIds:
    """Block ids of a prefix tree: one id per (parent id, content), assigned in first-seen order."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], int] = {}
        self._unique = 0

    def chain(self, contents: list[int], parent: int = -1) -> list[int]:
        """Ids of the blocks with these contents after block ``parent`` (-1: the start)."""
        out: list[int] = []
        ids = self._ids
        for content in contents:
            key = (parent, content)
            block = ids.get(key)
            if block is None:
                block = ids[key] = len(ids)
            out.append(block)
            parent = block
        return out

    def unique(self) -> int:
        """Content no other block has (a new message, a partial last block)."""
        self._unique += 1
        return -self._unique


class _Content:
    """Content ids of a workload's reusable pieces: piece ``(kind, index)`` has ``length`` blocks."""

    def __init__(self) -> None:
        self._next = 1 << 40
        self._pieces: dict[tuple[str, int], list[int]] = {}

    def piece(self, kind: str, index: int, length: int) -> list[int]:
        found = self._pieces.get((kind, index))
        if found is None:
            found = self._pieces[(kind, index)] = list(range(self._next, self._next + length))
            self._next += length
        return found


def _heavy_tail(rng: np.random.Generator, mean: float, alpha: float, cap: float) -> float:
    """A Pareto (Lomax) draw with the given mean (alpha > 1), capped."""
    scale = mean * (alpha - 1)
    return float(min(cap, scale * (rng.pareto(alpha))))


def _zipf_sampler(rng: np.random.Generator, n: int, s: float) -> Callable[[], int]:
    weights = np.cumsum(1.0 / np.arange(1, n + 1) ** s)
    weights /= weights[-1]
    return lambda: int(np.searchsorted(weights, rng.random(), side="right"))


Event = tuple[float, int, list[int]]
"""(arrival seconds, tie-breaker, block contents of the full prefix)."""

Session = tuple[float, int, list[int], int]
"""(time of its next request, id, block contents so far, requests left)."""

SessionEvent = tuple[float, int, list[int], int]
"""An :data:`Event` of a session: (arrival seconds, session id, block contents, requests left
in the session, this one included)."""


def _sessions(
    rng: np.random.Generator,
    rate: float,
    start: Callable[[int], tuple[list[int], int]],
    step: Callable[[list[int]], tuple[list[int], float]],
) -> Iterator[SessionEvent]:
    """Sessions arriving at ``rate`` per second, interleaved in time order, forever.

    ``start(session)`` gives a new session's first contents and its number of
    requests; ``step(contents)`` gives the next request's contents and the
    pause before it.
    """
    heap: list[Session] = []
    arrival, session = 0.0, 0
    while True:
        if not heap or arrival <= heap[0][0]:
            contents, requests = start(session)
            heapq.heappush(heap, (arrival, session, contents, requests))
            session += 1
            arrival += float(rng.exponential(1.0 / rate))
            continue
        now, s, contents, left = heapq.heappop(heap)
        yield now, s, contents, left
        if left > 1:
            following, pause = step(contents)
            heapq.heappush(heap, (now + pause, s, following, left - 1))


def _chat(rng: np.random.Generator, ids: _BlockIds, content: _Content, rate: float) -> Iterator[SessionEvent]:
    """Heavy-tailed multi-turn sessions: each turn adds the answer and the next message."""
    system = _zipf_sampler(rng, 6, 1.2)

    def start(session: int) -> tuple[list[int], int]:
        prompt = content.piece("chat-system", system(), 2 + session % 3)
        message = [ids.unique() for _ in range(1 + int(rng.integers(0, 3)))]
        return prompt + message, 1 + int(_heavy_tail(rng, 2.5, 1.6, 80))

    def step(contents: list[int]) -> tuple[list[int], float]:
        turn = [ids.unique() for _ in range(1 + int(rng.integers(0, 5)))]  # answer and next message
        return contents + turn, 5.0 + _heavy_tail(rng, 60.0, 1.8, 1800.0)

    return _sessions(rng, rate, start, step)


def _agentic(rng: np.random.Generator, ids: _BlockIds, content: _Content, rate: float) -> Iterator[SessionEvent]:
    """Agent loops: tools and a brief, then each step re-sends the context plus a tool's output."""
    tools = content.piece("agent-tools", 0, 6)

    def start(task: int) -> tuple[list[int], int]:
        brief = [ids.unique() for _ in range(2 + int(rng.integers(0, 12)))]
        return tools + brief, 2 + int(_heavy_tail(rng, 8.0, 1.7, 60))

    def step(contents: list[int]) -> tuple[list[int], float]:
        observation = [ids.unique() for _ in range(1 + int(rng.integers(0, 4)))]
        return contents + observation, 1.0 + _heavy_tail(rng, 6.0, 2.0, 300.0)

    return _sessions(rng, rate, start, step)


def _documents(
    rng: np.random.Generator, ids: _BlockIds, content: _Content, rate: float, phase_s: float | None
) -> Iterator[Event]:
    """RAG: system prompt, 1-3 Zipf-popular documents, the question.

    With ``phase_s``, which documents are popular changes every ``phase_s`` seconds.
    """
    corpus = 400
    doc = _zipf_sampler(rng, corpus, 1.1)
    system = content.piece("rag-system", 0, 3)
    order = rng.permutation(corpus)
    t, n, phase = 0.0, 0, 0
    while True:
        if phase_s is not None and t >= (phase + 1) * phase_s:
            order, phase = rng.permutation(corpus), phase + 1
        contents = list(system)
        for _ in range(1 + int(rng.integers(0, 3))):
            d = int(order[doc()])
            contents += content.piece("rag-doc", d, 2 + d % 9)
        contents += [ids.unique() for _ in range(1 + int(rng.integers(0, 2)))]
        yield t, n, contents
        n += 1
        t += float(rng.exponential(1.0 / rate))


def _api(rng: np.random.Generator, ids: _BlockIds, content: _Content, rate: float) -> Iterator[Event]:
    """Single-turn calls sharing Zipf-popular long system prompts."""
    prompts = 40
    prompt = _zipf_sampler(rng, prompts, 1.0)
    t, n = 0.0, 0
    while True:
        p = prompt()
        contents = list(content.piece("api-system", p, 4 + (7 * p) % 27))
        contents += [ids.unique() for _ in range(1 + int(_heavy_tail(rng, 3.0, 2.0, 40)))]
        yield t, n, contents
        n += 1
        t += float(rng.exponential(1.0 / rate))


def _docqa(rng: np.random.Generator, ids: _BlockIds, content: _Content, rate: float) -> Iterator[SessionEvent]:
    """Sessions of short questions about one long document from a Zipf-popular library."""
    library = 600
    document = _zipf_sampler(rng, library, 0.9)
    system = content.piece("docqa-system", 0, 2)

    def start(session: int) -> tuple[list[int], int]:
        d = document()
        doc = content.piece("docqa-doc", d, 16 + (37 * d) % 81)  # 16-96 blocks
        return system + doc + [ids.unique()], 1 + int(_heavy_tail(rng, 2.0, 1.8, 30))

    def step(contents: list[int]) -> tuple[list[int], float]:
        return [*contents[:-1], ids.unique()], 10.0 + _heavy_tail(rng, 40.0, 1.8, 900.0)  # the next question

    return _sessions(rng, rate, start, step)


def _code(rng: np.random.Generator, ids: _BlockIds, content: _Content, rate: float) -> Iterator[SessionEvent]:
    """Editor sessions: a repository's shared files, then the edited file up to the cursor.

    Each completion re-sends the prefix; the file grows by a block now and
    then, and an edit higher up (one completion in eight) replaces every
    block from the edited one on.
    """
    repository = _zipf_sampler(rng, 30, 1.1)

    def start(session: int) -> tuple[list[int], int]:
        r = repository()
        shared = content.piece("code-repo", r, 4 + (5 * r) % 17)  # 4-20 blocks of files the editor sends along
        opened = [ids.unique() for _ in range(1 + int(rng.integers(0, 8)))]
        return shared + opened, 5 + int(_heavy_tail(rng, 40.0, 1.6, 400))

    def step(contents: list[int]) -> tuple[list[int], float]:
        following = list(contents)
        if rng.random() < 0.25 and len(following) > 2:  # an edit higher up in the file
            at = int(rng.integers(max(1, len(following) - 12), len(following)))
            following[at:] = [ids.unique() for _ in range(len(following) - at)]
        if rng.random() < 0.3:  # the file grew by a block
            following.append(ids.unique())
        return following, 1.0 + _heavy_tail(rng, 4.0, 2.0, 120.0)

    return _sessions(rng, rate, start, step)


def _batch_bursts(
    rng: np.random.Generator, ids: _BlockIds, content: _Content, rate: float, on_s: float, off_s: float
) -> Iterator[Event]:
    """Bursts of a batch job at ``rate`` per second, ``on_s`` long on average, ``off_s`` apart.

    Every request: one of a few shared instructions, then a long document never
    seen again (6-30 blocks).
    """
    instruction = _zipf_sampler(rng, 3, 1.0)
    t, n = float(rng.exponential(off_s)), 0
    while True:
        end = t + float(rng.exponential(on_s))
        while t < end:
            contents = list(content.piece("batch-instruction", instruction(), 3))
            contents += [ids.unique() for _ in range(6 + int(rng.integers(0, 25)))]
            yield t, n, contents
            n += 1
            t += float(rng.exponential(1.0 / rate))
        t = end + float(rng.exponential(off_s))


def _streams(
    kind: str, rng: np.random.Generator, ids: _BlockIds, content: _Content, requests: int
) -> list[Iterator[Event | SessionEvent]]:
    if kind == "chat":
        return [_chat(rng, ids, content, 1.0)]
    if kind == "agentic":
        return [_agentic(rng, ids, content, 0.25)]
    if kind == "rag":
        return [_documents(rng, ids, content, 3.0, None)]
    if kind == "api":
        return [_api(rng, ids, content, 3.0)]
    if kind == "shift":
        return [_documents(rng, ids, content, 3.0, requests / 3.0 / 3.0)]  # three phases
    if kind == "docqa":
        return [_docqa(rng, ids, content, 1.0)]
    if kind == "code":
        return [_code(rng, ids, content, 0.1)]
    if kind == "bursty":
        return [
            _chat(rng, ids, content, 0.5),
            _api(rng, ids, content, 1.0),
            _batch_bursts(rng, ids, content, 4.0, 60.0, 400.0),
        ]
    return [  # mix
        _chat(rng, ids, content, 0.4),
        _agentic(rng, ids, content, 0.1),
        _documents(rng, ids, content, 1.0, None),
        _api(rng, ids, content, 1.0),
    ]


def generate(kind: str, requests: int = DEFAULT_REQUESTS, seed: int = 0) -> list[TraceRequest]:
    """The first ``requests`` requests of workload ``kind``, in arrival order.

    Raises :class:`ConfigError` for an unknown kind, a count that is not a whole number in
    [1, :data:`MAX_REQUESTS`] or a seed that is not a whole number >= 0.
    """
    return generate_with_hints(kind, requests, seed)[0]


def generate_with_hints(
    kind: str, requests: int = DEFAULT_REQUESTS, seed: int = 0
) -> tuple[list[TraceRequest], list[dict[str, object] | None]]:
    """:func:`generate`'s requests (the same ones), and per request the application hints a
    serving stack of that workload knows, as its per-request params (see
    :mod:`kvtier.request_control`), or None for a request of no session (rag, api, ...).

    A session's request carries ``kvtier_session`` (its stream and session number),
    ``kvtier_session_end`` (true on its session's last request) and, unless it is the
    last, ``kvtier_expected_return_s``: the pause until its session's next request
    (the generator knows it exactly; a real client's guess is rougher).
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown synthetic workload {kind!r}: use one of {', '.join(KINDS)}")
    # A count that is no whole number (5.5) never equals len(out) below: the streams are endless.
    if isinstance(requests, bool) or not isinstance(requests, int | np.integer):
        raise ConfigError(f"requests must be a whole, positive number of requests, got {requests!r:.40}")
    if requests <= 0:
        raise ConfigError(f"requests must be a positive number, got {requests}")
    if requests > MAX_REQUESTS:
        raise ConfigError(f"requests must be at most {MAX_REQUESTS}, got {requests}")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ConfigError(f"seed must be a whole number >= 0, got {seed!r:.40}")
    rng = np.random.Generator(np.random.PCG64(seed))
    ids, content = _BlockIds(), _Content()
    tagged = [_tag(stream, i) for i, stream in enumerate(_streams(kind, rng, ids, content, requests))]
    merged = heapq.merge(*tagged, key=lambda e: (e[0], e[1]))
    out: list[TraceRequest] = []
    sessions: list[tuple[str, int] | None] = []
    for arrival, _, contents, session in merged:
        blocks = [*ids.chain(contents), len(out) + (1 << 50)]  # plus the partial last block
        tokens = TRACE_BLOCK_TOKENS * (len(blocks) - 1) + 1 + int(rng.integers(0, TRACE_BLOCK_TOKENS - 1))
        out.append(TraceRequest(int(arrival * 1000), tokens, 1 + int(rng.integers(0, 512)), tuple(blocks)))
        sessions.append(session)
        if len(out) == requests:
            break
    return out, _hints(out, sessions)


def _tag(
    stream: Iterator[Event | SessionEvent], index: int
) -> Iterator[tuple[float, int, list[int], tuple[str, int] | None]]:
    """The events of stream ``index``, each with its session (id, requests left) if it has one."""
    for event in stream:
        yield event[0], event[1], event[2], (f"{index}-{event[1]}", event[3]) if len(event) > 3 else None


def _hints(out: list[TraceRequest], sessions: list[tuple[str, int] | None]) -> list[dict[str, object] | None]:
    """The hints of each request of ``out`` (see :func:`generate_with_hints`)."""
    hints: list[dict[str, object] | None] = [None] * len(out)
    following: dict[str, int] = {}  # session -> its next request's index, walking backwards
    for i in range(len(out) - 1, -1, -1):
        session = sessions[i]
        if session is None:
            continue
        name, left = session
        params: dict[str, object] = {"kvtier_session": name, "kvtier_session_end": left <= 1}
        after = following.get(name)
        if after is not None:
            params["kvtier_expected_return_s"] = (out[after].timestamp_ms - out[i].timestamp_ms) / 1000
        following[name] = i
        hints[i] = params
    return hints
