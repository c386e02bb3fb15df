"""Which backend takes a request, and how much room a backend has (the saturation signal).

The pool filters out backends that cannot take the request at all (wrong model, no free slot,
token budget); the chooser ranks what is left.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from proxy.policies.types import BackendView, ScrapedLoad

if TYPE_CHECKING:
    from proxy.config.backends import BackendHealth


B = TypeVar("B", bound=BackendView)


@dataclass(frozen=True, slots=True)
class Candidate(Generic[B]):
    state: B
    room: float  # free slots, at least 1
    load: ScrapedLoad | None  # the scraped load if fresh


class BackendChooser(Protocol):
    def room(self, state: BackendView, now: float, health: BackendHealth) -> float:
        """Free request slots on this backend now (may be fractional during a ramp)."""

    def pick(self, candidates: Sequence[Candidate[B]], prefix: int | None) -> B | None:
        """The backend for a request among those that can take it (None when empty)."""

    def served(self, state: BackendView, prefix: int | None) -> None:
        """A request with this prompt prefix hash (None: unknown) was sent to ``state``."""


def slot_room(state: BackendView, now: float, health: BackendHealth) -> float:
    """The room controller's slots (``max_inflight``, or learned), ramped after a
    reinstatement, shrunk by vLLM's own queue beyond the allowance, less what is in flight."""
    if not state.available(now):
        return 0.0
    cap = state.max_room
    if state.reinstated_at is not None and health.ramp_s > 0:
        ramp = min(1.0, 0.25 + 0.75 * (now - state.reinstated_at) / health.ramp_s)
        cap = max(1.0, cap * ramp)  # a returning backend always takes at least one
    load = state.fresh_load(now, health.stale_after_s)
    if load is not None:
        # vLLM's own queue beyond the allowance means this backend holds more than it runs:
        # shrink its room by that excess, so the backlog stays here, where the tiers order
        # it. (Its queue always holds a request or two between steps; that is no signal.)
        excess = load.waiting - health.max_backend_waiting
        if excess > 0:
            cap = max(1.0, cap - excess)
    return max(0.0, cap - state.inflight)


def least_utilised(candidates: Sequence[Candidate[B]]) -> B | None:
    """The backend that stays least utilised after taking the request (so work spreads in
    proportion to each backend's room); ties toward free KV cache, then config order."""
    best: B | None = None
    best_score = 0.0
    for c in candidates:
        score = (c.room - 1.0) / c.state.max_room  # free share left after this one
        if c.load is not None:
            score -= 0.01 * c.load.kv_usage
        if best is None or score > best_score:
            best, best_score = c.state, score
    return best


class LeastUtilised:
    def room(self, state: BackendView, now: float, health: BackendHealth) -> float:
        return slot_room(state, now, health)

    def pick(self, candidates: Sequence[Candidate[B]], prefix: int | None) -> B | None:
        return least_utilised(candidates)

    def served(self, state: BackendView, prefix: int | None) -> None:
        pass


class PrefixAffinity:
    """The backend that last served the same prompt prefix, if it can take the request (its
    prefix cache probably still holds it), else the least utilised. Remembers the last
    ``capacity`` prefixes (least recently used dropped first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._last: OrderedDict[int, str] = OrderedDict()  # prefix hash -> backend url

    def room(self, state: BackendView, now: float, health: BackendHealth) -> float:
        return slot_room(state, now, health)

    def pick(self, candidates: Sequence[Candidate[B]], prefix: int | None) -> B | None:
        url = self._last.get(prefix) if prefix is not None else None
        if url is not None:
            for c in candidates:
                if c.state.cfg.url == url:
                    return c.state
        return least_utilised(candidates)

    def served(self, state: BackendView, prefix: int | None) -> None:
        if prefix is None:
            return
        self._last[prefix] = state.cfg.url
        self._last.move_to_end(prefix)
        if len(self._last) > self.capacity:
            self._last.popitem(last=False)
