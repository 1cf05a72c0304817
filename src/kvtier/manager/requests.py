"""The manager's requests: one :class:`RequestState` per request it knows, what each allows,
and the cascades of request-level tiers.

A request's state lives from its first store, promotion or ``on_new_request``
until it finished and nothing of it is outstanding (no device store awaiting
completion, no cascade parked, no promotion waiting for step end); then the
manager tells the tiers it finished. Per-request control
(:mod:`kvtier.request_control`) is parsed from the request's params once and
kept in ``request.control``. A tier that asked for a request at request level gets
the request's blocks found in the CPU tier when the request stores them; a block
still being written is parked until step end, and dropped (counted
``cascade_expired`` on those tiers) once parked longer than the wait deadline, so a
write that never ends never keeps the request, or ``has_pending_work()``, alive.

Scheduler thread only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from time import perf_counter

from kvtier.keys import BlockKey
from kvtier.manager.handle import TierHandle
from kvtier.manager.ledger import Ledger
from kvtier.manager.tierset import TierSet
from kvtier.primary import PrimaryTier
from kvtier.request_control import (
    CONTROL_KEYS,
    ControlProblem,
    ControlProblemLog,
    TierDescriptor,
    parse_control_problems,
)
from kvtier.types import DEFAULT_CONTROL, RequestContext, RequestControl

logger = logging.getLogger(__name__)

FINISHED_KEPT = 4096
"""Finalized request ids remembered, so a repeated ``on_request_finished`` reaches no tier twice."""


@dataclass(eq=False)
class RequestState:
    """What the manager tracks of one request."""

    request: RequestContext
    seq: int  # creation order: step-end work visits requests in this order
    request_level_tiers: list[TierHandle] = field(default_factory=list)
    pending_store_keys: set[BlockKey] = field(default_factory=set)
    parked_cascades: list[BlockKey] = field(default_factory=list)
    parked_since: float = 0.0  # when the oldest parked cascade was parked
    finished: bool = False
    chain_tail: BlockKey | None = None  # the last block loaded or stored: the parent of the next
    stored_tail: bool = False  # chain_tail was written by this request (a next store continues it; its end is ours)
    in_step: bool = False
    """Listed for this step's end: promotions wait for submission, or cascades are parked."""

    def note_store(self, keys: Sequence[BlockKey], keys_to_store: Sequence[BlockKey]) -> None:
        """The request stored ``keys`` (``keys_to_store`` of them are new): its next store follows
        them, and continues its own store if this request wrote their tail. A tail another request
        wrote (every key already held) is not this request's: its end and hints are not told of it."""
        if keys:
            tail = keys[-1]
            own = bool(keys_to_store) and keys_to_store[-1] == tail
            self.stored_tail = own or (self.stored_tail and tail == self.chain_tail)
            self.chain_tail = tail
        self.pending_store_keys.update(keys_to_store)


def _by_seq(state: RequestState) -> int:
    return state.seq


class RequestTable:
    """The states of the requests the manager knows, by ``req_id``; ``len()`` counts them."""

    def __init__(self, descriptors: Sequence[TierDescriptor], tiers: TierSet, primary: PrimaryTier, jobs: Ledger,
                 wait_timeout: float) -> None:
        self.descriptors = tuple(descriptors)
        """Index, label, type and locality of every tier, the CPU tier first (what selectors match)."""
        self._states: dict[str, RequestState] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()  # the last FINISHED_KEPT finalized ids
        self._next_seq = 0
        self._step: list[RequestState] = []
        self._control_problems = ControlProblemLog(logger)
        self._tiers = tiers
        self._primary = primary
        self._jobs = jobs
        self._wait_timeout = wait_timeout

    def __len__(self) -> int:
        return len(self._states)

    def find(self, request: RequestContext | None) -> RequestState | None:
        """``request``'s state if it has one (never creates one)."""
        return None if request is None else self._states.get(request.req_id)

    def state(self, request: RequestContext | None) -> RequestState | None:
        """``request``'s state, made on first use; None for no request."""
        if request is None:
            return None
        state = self._states.get(request.req_id)
        if state is None:
            state = self._states[request.req_id] = RequestState(request, self._next_seq)
            self._next_seq += 1
            if self._finished:
                self._finished.pop(request.req_id, None)  # an id used again: a new request
        return state

    def first_finish(self, request: RequestContext) -> bool:
        """``request``, unknown now, finishes: True unless it was finalized (or finished) lately,
        when its tiers heard it already; remembered either way."""
        first = request.req_id not in self._finished
        self._remember_finished(request.req_id)
        return first

    def _remember_finished(self, req_id: str) -> None:
        self._finished[req_id] = None
        if len(self._finished) > FINISHED_KEPT:
            self._finished.popitem(last=False)

    def finalize_if_done(self, state: RequestState) -> None:
        """Forget ``state`` and tell the tiers its request finished, once nothing of it is
        outstanding (it finished, no device store awaits completion, nothing waits for step end)."""
        if state.finished and not state.pending_store_keys and not state.in_step:
            del self._states[state.request.req_id]
            self._remember_finished(state.request.req_id)
            self._tiers.broadcast("on_request_finished", state.request)

    def list_for_step(self, state: RequestState) -> None:
        """List ``state`` for this step's end (promotions to submit, cascades parked)."""
        if not state.in_step:
            state.in_step = True
            self._step.append(state)

    @property
    def has_step_work(self) -> bool:
        return bool(self._step)

    def any_parked(self) -> bool:
        """A cascade waits for its block's write to finish."""
        return any(state.parked_cascades for state in self._step)

    def cascade(self, state: RequestState, keys: list[BlockKey]) -> None:
        """Cascade ``keys``, blocks a request-level store found in the CPU tier, to the request's
        request-level tiers; those still being written are parked until step end."""
        ready: list[BlockKey] = []
        for key in keys:
            ref = self._primary.ref_count(key)
            if ref is None:
                continue
            if ref < 0:
                if not state.parked_cascades:
                    state.parked_since = perf_counter()
                state.parked_cascades.append(key)
                self.list_for_step(state)
            else:
                ready.append(key)
        if not ready:
            return
        request = state.request
        wanted = self.control(request).cascade_to
        targets = self._tiers.admit(self._tiers.targets(state.request_level_tiers, wanted), ready, request)
        if targets:
            self._jobs.submit_cascades(ready, self._primary.pin_slots(ready, len(targets)), targets, request)

    def end_step(self) -> None:
        """Step end: the listed requests, in the order they came, flush their parked cascades (those
        parked past the wait deadline are dropped) and are finalized if done."""
        states, self._step = self._step, []
        states.sort(key=_by_seq)
        for state in states:
            state.in_step = False
        for state in states:
            if state.parked_cascades:
                parked, state.parked_cascades, since = state.parked_cascades, [], state.parked_since
                if perf_counter() - since > self._wait_timeout:
                    ready = [key for key in parked if (self._primary.ref_count(key) or 0) >= 0]
                    for handle in state.request_level_tiers if len(ready) < len(parked) else ():
                        handle.telemetry.fail("cascade_expired", len(parked) - len(ready))
                    parked = ready
                self.cascade(state, parked)  # lists the state again if still parked
                state.parked_since = since
            self.finalize_if_done(state)

    def reset(self) -> list[RequestState]:
        """Forget everything outstanding (the CPU tier is being reset); every state, to finalize."""
        self._step.clear()
        states = list(self._states.values())
        for state in states:
            state.pending_store_keys.clear()
            state.parked_cascades.clear()
            state.in_step = False
        return states

    def control_problems(self) -> dict[str, int]:
        """Malformed request settings seen so far, by ``"<key>:<kind>"`` (counts only)."""
        return self._control_problems.counts()

    def control(self, request: RequestContext) -> RequestControl:
        """What ``request`` allows, parsed from its params once and kept in ``request.control``.
        Malformed keys fall back to their defaults (a request is never refused for them), are
        counted per kind and logged at the 1st, 10th, 100th... occurrence; nothing of the value
        is kept (:class:`~kvtier.request_control.ControlProblemLog`)."""
        if not isinstance(request, RequestContext):
            raise TypeError(f"request must be a RequestContext (or None), got {type(request).__name__}")
        control = request.control
        if control is None:
            params = request.params
            if params is not None and not isinstance(params, Mapping):  # no truth test of a stranger's object
                problem = ControlProblem("params", "not_a_mapping", f"params must be a mapping of settings, got "  # type: ignore[unreachable]
                                         f"{type(params).__name__}")  # fmt: skip
                self._control_problems.record(request.req_id, [problem])
                control = DEFAULT_CONTROL
            elif not params or not any(key in params for key in CONTROL_KEYS):
                control = DEFAULT_CONTROL
            else:
                control, problems = parse_control_problems(params, self.descriptors)
                self._control_problems.record(request.req_id, problems)
                if control.is_default:  # e.g. only malformed keys: the default's fast paths apply
                    control = DEFAULT_CONTROL
            request.control = control
        return control


__all__ = ["RequestState", "RequestTable"]
