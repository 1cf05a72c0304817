"""The CPU-hit run of a prefix scan, answered with C-level passes over the keys.

:meth:`TieringManager.lookup_prefix <kvtier.manager.core.TieringManager.lookup_prefix>`
answers a request's leading CPU hits here: the index probe and the row-state
read of a run of keys are ``map`` calls, so the interpreter runs no bytecode per
key (a Python loop of the same probes cost about 1.5x a bare ``dict.get`` loop
on ``bench_vs_vllm``). The caller records the hits; this module only reads and computes.
Scheduler thread only; never blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from kvtier.keys import BlockKey

CHUNK = 64
"""Keys probed per pass: a run that stops early (a MISS after a few hits) wastes at most this many probes."""


def ready_run(
    slot_get: Callable[[BlockKey], int | None], refs: list[int], in_flight: int, keys: Sequence[BlockKey], start: int
) -> int:
    """How many keys from ``keys[start]`` on are ready CPU blocks (indexed, not ``in_flight``),
    stopping at the first that is not or is not ``bytes`` (the caller's full lookup answers or
    rejects that one). ``slot_get`` and ``refs`` are the CPU tier's index and ref counts."""
    n = len(keys)
    i = start
    while i < n:
        chunk = keys if i == 0 and n <= CHUNK else keys[i : i + CHUNK]
        size = len(chunk)
        if list(map(type, chunk)).count(bytes) != size:  # a key of another type ends the run before it
            size = next(j for j, key in enumerate(chunk) if type(key) is not bytes)
            chunk = chunk[:size]
        slots = list(map(slot_get, chunk))
        try:
            states = list(map(refs.__getitem__, slots))  # type: ignore[arg-type]
        except TypeError:  # a None: the first key not in the tier ends the run
            states = list(map(refs.__getitem__, cast("list[int]", slots[: slots.index(None)])))
        found = states.index(in_flight) if in_flight in states else len(states)
        i += found
        if found < CHUNK:
            break
    return i - start
