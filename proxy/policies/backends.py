"""Which backend takes a request, and how much room a backend has (the saturation signal).

The pool filters out backends that cannot take the request at all (wrong model, no free slot,
token budget); the chooser ranks what is left.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from proxy.policies.types import BackendView, QueuedRequest, ScrapedLoad

if TYPE_CHECKING:
    from proxy.config.backends import BackendHealth


B = TypeVar("B", bound=BackendView)


@dataclass(frozen=True, slots=True)
class Candidate(Generic[B]):
    state: B
    room: float  # free slots, at least 1
    load: ScrapedLoad | None  # the scraped load if fresh


class BackendChooser(Protocol):
    """Ranks the backends that can take a request (the room of each is ``slot_room``'s, the
    same whichever chooser ranks them)."""

    def pick(
        self,
        candidates: Sequence[Candidate[B]],
        request: QueuedRequest | None,
        *,
        now: float | None = None,
        full: Sequence[B] = (),
    ) -> B | None:
        """The backend for ``request`` (None: nothing known of it) among those that can take
        it; None: none, or the request waits for one of ``full`` (the backends that serve it,
        available but without a free slot now). ``now``: the pool's clock."""

    def served(self, state: BackendView, request: QueuedRequest | None) -> None:
        """``request`` (None: nothing known of it) was sent to ``state``."""

    def ended(self, state: BackendView, request: QueuedRequest | None, ran: bool | None) -> None:
        """``request``, sent to ``state`` (``served``), ended. ``ran`` False: the engine did
        no work for it (it answered a 4xx, the connection failed before it was sent, its
        handler left first): what ``served`` kept of it goes, and leaves no trace. None: its
        client left before the engine answered (it may have waited in vLLM's own queue)."""

    def next_hold_end(self, now: float) -> float | None:
        """Seconds until the first request ``pick`` holds back for a full backend may go
        elsewhere (the dispatcher looks again then, not only when a slot frees); None: none
        is held."""

    def left(self, request: QueuedRequest) -> None:
        """``request`` left the queue unserved (its client went, it timed out or was
        displaced): what ``pick`` kept for it goes."""


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


def least_utilised(candidates: Sequence[Candidate[B]], rotation: Rotation) -> B | None:
    """The backend that stays least utilised after taking the request (so work spreads in
    proportion to each backend's room); ties toward free KV cache, then to the backend
    ``rotation`` chose longest ago. An idle backend scores as if
    all its room were free: idle backends tie whatever their room, and a light load takes
    turns over them (a learned room of 20 against 19 sent every request of a light load to
    the backend with 20: red team)."""
    best: B | None = None
    best_key = (0.0, 0)
    for c in candidates:
        share = _idle_share(c) if c.state.inflight == 0 else free_share(c)
        key = (round(share / TIE) * TIE, rotation.age(c.state))
        if best is None or key > best_key:
            best, best_key = c.state, key
    return best


def _idle_share(c: Candidate[B]) -> float:
    """``free_share`` of a backend with nothing in flight, as if taking the request left all
    its room free (less the same KV term)."""
    return 1.0 - 0.01 * c.load.kv_usage if c.load is not None else 1.0


def free_share(c: Candidate[B]) -> float:
    """The share of the backend's room left after it takes one more request, a little less
    the fuller its KV cache (``least_utilised``'s score)."""
    score = slot_share(c)
    return score - 0.01 * c.load.kv_usage if c.load is not None else score


def slot_share(c: Candidate[B]) -> float:
    """The share of the backend's slots left after it takes one more request (``free_share``
    without the KV its requests in flight hold: where that matters, ``kvfit`` weighs the KV a
    request would need past the cache, counting the blocks it shares with them once)."""
    score = (c.room - 1.0) / c.state.max_room
    if c.state.inflight >= c.state.max_room:
        # A best-tier reserve slot: after a backend with room of its own at equal load (the
        # full one may be stuck), by half a slot, so a prefix cached there still counts.
        score -= 0.5 / c.state.max_room
    return score


# Scores closer than this are a tie (float noise of equal loads must not decide).
TIE = 1e-9


class Rotation:
    """The last tie-break of a balanced choice: the backend chosen longest ago (never config
    order, which piles every tie onto the first backend)."""

    def __init__(self) -> None:
        self._seq = 0
        self._last: dict[str, int] = {}  # backend url -> sequence number of its last pick

    def age(self, state: BackendView) -> int:
        """Higher for a backend chosen longer ago (never chosen: highest)."""
        return -self._last.get(state.cfg.url, -1)

    def chose(self, state: BackendView) -> None:
        self._seq += 1
        self._last[state.cfg.url] = self._seq


class NeverHolds:
    """What a chooser that never holds a request back says of holds."""

    def next_hold_end(self, now: float) -> float | None:
        return None

    def left(self, request: QueuedRequest) -> None:
        pass

    def ended(self, state: BackendView, request: QueuedRequest | None, ran: bool | None) -> None:
        pass  # what it remembers is shaped at dispatch (kv_aware keeps only what ran)


class LeastUtilised(NeverHolds):
    """``least_utilised``, ties by rotation: on a near-idle pool every backend scores the same
    (nothing in flight), and config order sent 72-76 % of a light load to the first engine
    (issue 32's real runs)."""

    def __init__(self) -> None:
        self._rotation = Rotation()

    def pick(
        self,
        candidates: Sequence[Candidate[B]],
        request: QueuedRequest | None,
        *,
        now: float | None = None,
        full: Sequence[B] = (),
    ) -> B | None:
        return least_utilised(candidates, self._rotation)

    def served(self, state: BackendView, request: QueuedRequest | None) -> None:
        self._rotation.chose(state)


class PrefixAffinity(NeverHolds):
    """The backend that last served the same prompt prefix, if it can take the request (its
    prefix cache probably still holds it). A new prefix goes to the least utilised backend;
    ties go to the backend that holds fewer remembered prefixes, then to the one chosen
    longest ago (config order would pile every new prefix onto the first backend while both
    are idle, and affinity then keeps them there: identical runs split 198/72). Remembers the
    last ``capacity`` prefixes (least recently used dropped first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._last: OrderedDict[int, str] = OrderedDict()  # prefix hash -> backend url
        self._owned: dict[str, int] = {}  # backend url -> prefixes of ``_last`` it holds
        self._rotation = Rotation()

    def pick(
        self,
        candidates: Sequence[Candidate[B]],
        request: QueuedRequest | None,
        *,
        now: float | None = None,
        full: Sequence[B] = (),
    ) -> B | None:
        prefix = request.prefix_hash if request is not None else None
        url = self._last.get(prefix) if prefix is not None else None
        if url is not None:
            for c in candidates:
                if c.state.cfg.url == url:
                    return c.state
        best: Candidate[B] | None = None
        best_key = (0, 0, 0)
        for c in candidates:
            key = (
                round(free_share(c) / TIE),
                -self._owned.get(c.state.cfg.url, 0),
                self._rotation.age(c.state),
            )
            if best is None or key > best_key:
                best, best_key = c, key
        return best.state if best is not None else None

    def served(self, state: BackendView, request: QueuedRequest | None) -> None:
        self._rotation.chose(state)
        prefix = request.prefix_hash if request is not None else None
        if prefix is None:
            return
        url = state.cfg.url
        old = self._last.get(prefix)
        if old != url:
            if old is not None:
                self._owned[old] -= 1
            self._owned[url] = self._owned.get(url, 0) + 1
        self._last[prefix] = url
        self._last.move_to_end(prefix)
        if len(self._last) > self.capacity:
            _, dropped = self._last.popitem(last=False)
            self._owned[dropped] -= 1
