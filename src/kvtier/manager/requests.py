"""The manager's requests: one :class:`RequestState` per request it knows, and what each allows.

A request's state lives from its first store, promotion or ``on_new_request``
until it finished and nothing of it is outstanding (no device store awaiting
completion, no cascade parked, no promotion waiting for step end); then the
manager tells the tiers it finished. Per-request control
(:mod:`kvtier.request_control`) is parsed from the request's params once and
kept in ``request.control``.

Scheduler thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.keys import BlockKey
from kvtier.manager.tierset import TierHandle, TierSet
from kvtier.request_control import CONTROL_KEYS, ControlProblemLog, TierDescriptor, parse_control_problems
from kvtier.types import DEFAULT_CONTROL, RequestContext, RequestControl

logger = logging.getLogger(__name__)

@dataclass(eq=False)
class RequestState:
    """What the manager tracks of one request."""

    request: RequestContext
    seq: int  # creation order: step-end work visits requests in this order
    request_level_tiers: list[TierHandle] = field(default_factory=list)
    pending_store_keys: set[BlockKey] = field(default_factory=set)
    parked_cascades: list[BlockKey] = field(default_factory=list)
    finished: bool = False
    chain_tail: BlockKey | None = None  # the last block loaded or stored: the parent of the next
    stored_tail: bool = False  # chain_tail was stored by this request (a next store continues it)
    in_step: bool = False
    """Listed for this step's end: promotions wait for submission, or cascades are parked."""

    def note_store(self, keys: Sequence[BlockKey], keys_to_store: Sequence[BlockKey]) -> None:
        """The request stored ``keys`` (``keys_to_store`` of them are new): its next store continues them."""
        if keys:
            self.chain_tail = keys[-1]
            self.stored_tail = True
        self.pending_store_keys.update(keys_to_store)


def _by_seq(state: RequestState) -> int:
    return state.seq


class RequestTable:
    """The states of the requests the manager knows, by ``req_id``; ``len()`` counts them."""

    def __init__(self, descriptors: Sequence[TierDescriptor], tiers: TierSet) -> None:
        self.descriptors = tuple(descriptors)
        """Index, label, type and locality of every tier, the CPU tier first (what selectors match)."""
        self._states: dict[str, RequestState] = {}
        self._next_seq = 0
        self._step: list[RequestState] = []
        self._control_problems = ControlProblemLog(logger)
        self._tiers = tiers

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
        return state

    def finalize_if_done(self, state: RequestState) -> None:
        """Forget ``state`` and tell the tiers its request finished, once nothing of it is
        outstanding (it finished, no device store awaits completion, nothing waits for step end)."""
        if state.finished and not state.pending_store_keys and not state.in_step:
            del self._states[state.request.req_id]
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

    def take_step(self) -> list[RequestState]:
        """This step's listed states, in the order the requests came, no longer listed."""
        states, self._step = self._step, []
        states.sort(key=_by_seq)
        for state in states:
            state.in_step = False
        return states

    def reset(self) -> list[RequestState]:
        """Forget everything outstanding (the CPU tier is being reset); every state, to finalize."""
        self._step.clear()
        states = list(self._states.values())
        for state in states:
            state.pending_store_keys.clear()
            state.parked_cascades.clear()
            state.in_step = False
        return states

    def control(self, request: RequestContext) -> RequestControl:
        """What ``request`` allows, parsed from its params once and kept in ``request.control``.
        Malformed keys fall back to their defaults (a request is never refused for them), are
        counted per kind and logged at the 1st, 10th, 100th... occurrence; nothing of the value
        is kept (:class:`~kvtier.request_control.ControlProblemLog`)."""
        control = request.control
        if control is None:
            params = request.params
            if not params or not any(key in params for key in CONTROL_KEYS):
                control = DEFAULT_CONTROL
            else:
                control, problems = parse_control_problems(params, self.descriptors)
                self._control_problems.record(request.req_id, problems)
            request.control = control
        return control


__all__ = ["RequestState", "RequestTable"]
