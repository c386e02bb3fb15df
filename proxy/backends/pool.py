"""All backends: their room, the candidates for a request at dispatch time, bookkeeping of what
runs where, and the models they serve. Pure logic, no I/O.

The proxy's own in-flight counts come first (exact, instant); the load scraped from each vLLM's
``/metrics`` corrects them (a backend whose own waiting queue grows gets no new work until it
drains); scraped load older than ``stale_after_s`` is ignored on purpose and its age exported.
The room of a backend and the choice among candidates belong to the chooser policy
(``proxy.policies.backends``); how many requests a backend may hold at once, fixed or learned,
to its room controller (``proxy.policies.room``); ejection and reinstatement to
``proxy.backends.health``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from proxy.backends.adapter_choice import adapter_able, adapter_begin, serves_adapter
from proxy.backends.adapter_rules import AdapterPolicy
from proxy.backends.adapter_slots import LoadPlan
from proxy.backends.backend import BackendState
from proxy.backends.cheap_calls import give_back_cheap, take_cheap
from proxy.backends.health import OutlierDetection, passed_over
from proxy.config.backends import Backend, BackendHealth
from proxy.config.slo import AdaptiveRoom
from proxy.policies.backends import BackendChooser, Candidate, slot_room
from proxy.policies.room import GradientRoom, RoomChange, RoomSignals, room_controller
from proxy.policies.token_reservations import TokenReservations
from proxy.policies.types import QueuedRequest


class BackendPool:
    """All backends, their room, their health; which one takes a request: the chooser's."""

    def __init__(
        self,
        backends: Iterable[Backend],
        health: BackendHealth,
        chooser: BackendChooser,
        adaptive: AdaptiveRoom | None = None,
        *,
        miss_budget: float = 0.01,
    ) -> None:
        self.health = health
        self.outliers = OutlierDetection(health)
        self.chooser = chooser
        self.adaptive = adaptive or AdaptiveRoom()
        self.miss_budget = miss_budget  # share of requests allowed to miss their tier's SLO
        # Slots past a backend's room that only the best tiers take, while worse tiers hold
        # as many of its slots (``scheduling.best_tier_reserve``; set by the builder).
        self.best_tier_reserve = 0
        self.best_tiers: frozenset[str] = frozenset()
        self.states: dict[str, BackendState] = {}
        # Shared state: proxy.replicas.room is told when a backend runs out of granted room
        # (False) or frees a slot (True), proxy.replicas.adapter_claims when a claim may change.
        self.on_shared_room: Callable[[bool], None] | None = None
        self.on_adapter_claims: Callable[[], None] | None = None
        # The `adapters:` catalogue: adapter name -> its base model, and how tiers and tenants
        # share adapter slots (both set by the builder).
        self.adapters: Mapping[str, str] = {}
        self.adapter_policy = AdapterPolicy()
        # Which backend drains for a request no token budget fits (ranks set by the builder).
        self.token_reservations = TokenReservations()
        self.reconfigure(backends, health)

    def reconfigure(
        self,
        backends: Iterable[Backend],
        health: BackendHealth,
        adaptive: AdaptiveRoom | None = None,
        *,
        miss_budget: float | None = None,
    ) -> None:
        """Keep the state of backends that stay; drain those that left (they finish their work
        and are dropped once idle). A learned room survives a reload unless its parameters or
        the backend's kind of room changed."""
        self.health = health
        self.outliers.health = health
        renew = adaptive is not None and adaptive != self.adaptive
        self.adaptive = adaptive or self.adaptive
        if miss_budget is not None:
            self.miss_budget = miss_budget
        wanted = {b.url: b for b in backends}
        self.token_reservations.forget(url for url in self.states if url not in wanted)
        for url, state in list(self.states.items()):
            if url in wanted:
                kind_changed = state.cfg.adaptive_room != wanted[url].adaptive_room
                state.cfg = wanted[url]
                if renew or kind_changed:
                    state.room_controller = room_controller(
                        state.cfg, self.adaptive, self.miss_budget
                    )
                elif state.room_controller is not None:
                    state.room_controller.set_ceiling(self.adaptive.ceiling(state.cfg.max_inflight))
                    if isinstance(state.room_controller, GradientRoom):
                        state.room_controller.miss_budget = self.miss_budget
                if state.removed:
                    state.removed = state.draining = False
            elif state.inflight == 0:
                del self.states[url]
            else:
                state.removed = state.draining = True
        for url, cfg in wanted.items():
            if url not in self.states:
                self.states[url] = BackendState(
                    cfg=cfg, room_controller=room_controller(cfg, self.adaptive, self.miss_budget)
                )

    def tick_room(self, state: BackendState, now: float) -> RoomChange | None:
        """One look of the backend's room controller (after each monitor pass)."""
        if state.room_controller is None:
            return None
        load = state.fresh_load(now, self.health.stale_after_s)
        signals = RoomSignals(
            load=load,
            had_metrics=state.load is not None,
            peak_inflight=state.peak_inflight,
            transit=state.in_transit(load),
            allowance=float(self.health.max_backend_waiting),
        )
        state.peak_inflight = state.inflight
        return state.room_controller.tick(now, signals)

    def observe_latency(self, state: BackendState, now: float, met: bool | None) -> None:
        """A request on this backend ended; whether its backend-side latency met its target
        (None: no target, or nothing to judge)."""
        if met is not None and state.room_controller is not None:
            state.room_controller.observe(now, met)

    def slots(self) -> float:
        """Room of all backends together (for a rough Retry-After)."""
        return sum(s.max_room for s in self.states.values())

    def all(self) -> list[BackendState]:
        return list(self.states.values())

    # -- choice --------------------------------------------------------------------------
    def room(self, state: BackendState, now: float, *, best: bool = False) -> float:
        """Free request slots on this backend now (may be fractional during a ramp); for a
        request of the best tier (``best``), with the best-tier reserve when the room is full."""
        room = slot_room(state, now, self.health)
        if best and room < 1.0:
            room = max(room, self.reserve_room(state, now))
        if state.granted is not None:
            granted = state.granted - state.inflight
            if granted < 1 and self.on_shared_room is not None:
                self.on_shared_room(False)
            room = max(0.0, min(room, granted))
        return room

    def reserve_room(self, state: BackendState, now: float) -> float:
        """Slots past the full room that a best-tier request may take: at most the reserve,
        and at most as many as worse tiers run there. Inside vLLM the plugin preempts a
        worse-tier request for each (docs/plugin.md), so the engine never runs more than its
        room; without the plugin, the request waits in vLLM's queue instead of the proxy's."""
        if not state.available(now):
            return 0.0
        worse = state.inflight - state.best_inflight
        return float(max(0, min(self.best_tier_reserve, worse) - state.reserve_inflight))

    def choose(
        self,
        model: str | None,
        tokens: float,
        now: float,
        *,
        request: QueuedRequest | None = None,
        best: bool = False,
    ) -> BackendState | None:
        """The chooser's pick among the backends that serve the model, fit the tokens and have
        a free slot (``best``: a best-tier request, which may take the reserve); None if none
        can take it; one that only the token budgets refuse makes a backend drain for it."""
        candidates: list[Candidate[BackendState]] = []
        full: list[BackendState] = []
        short_of_tokens: dict[str, float] = {}
        failed = request.failed_on if request is not None else frozenset()
        avoid = passed_over(self.states.values(), failed, model, now)
        tenant, tier = (request.tenant, request.tier) if request is not None else ("", "")
        wait = (request.arrival_s, request.deadline_s, now) if request is not None else None
        user = self.adapter_policy.user(tenant, tier, best, wait)
        policy = self.adapter_policy
        states = self._open_to(request, now)
        able = adapter_able(states, self.adapters, model, policy, user, now)
        if able is not None and not (able[0] or able[1]) and self.on_adapter_claims is not None:
            self.on_adapter_claims()  # proxy.replicas.adapter_claims claims what is wanted
        for state in states:
            takes = state.cfg.url in able[0] | able[1] if able is not None else state.serves(model)
            if not takes or state.cfg.url in avoid:
                continue
            if not state.fits_tokens(tokens, best=best and self.best_tier_reserve > 0):
                if state.available(now):
                    short_of_tokens[state.cfg.url] = state.tokens_inflight
                continue
            room = self.room(state, now, best=best)
            if room >= 1.0:
                load = state.fresh_load(now, self.health.stale_after_s)
                candidates.append(Candidate(state, room, load))
            elif state.available(now):
                full.append(state)
        if able is not None and any(c.state.cfg.url in able[0] for c in candidates):
            # An adapter goes where it is held while one of those has room (no load).
            candidates = [c for c in candidates if c.state.cfg.url in able[0]]
        if not candidates:
            if request is not None and short_of_tokens:
                self.token_reservations.reserve(request, short_of_tokens)
            return None
        return self.chooser.pick(candidates, request, now=now, full=full)

    def note_adapter_wait(self, request: QueuedRequest, best: bool, now: float) -> None:
        """Note on the backends where ``request`` waits for an adapter slot that it does."""
        wait = (request.arrival_s, request.deadline_s, now)
        user = self.adapter_policy.user(request.tenant, request.tier, best, wait)
        states, policy = self._open_to(request, now), self.adapter_policy
        adapter_able(states, self.adapters, request.model, policy, user, now)

    def _open_to(self, request: QueuedRequest | None, now: float) -> list[BackendState]:
        """The backends no token hold keeps ``request`` from: an adapter request noted waiting
        where a hold refused it kept the holder from its idle adapter (red team A1, stop 51)."""
        holds = self.token_reservations
        return [
            s
            for s in self.states.values()
            if holds.admits(s.cfg.url, request) or s.relays_only(now, self.health)
        ]

    def serves_adapter(self, model: str) -> bool:
        return serves_adapter(self.states.values(), self.adapters, model)

    def any_room(self, now: float, *, best: bool = False) -> bool:
        return any(self.room(s, now, best=best) >= 1.0 for s in self.states.values())

    def any_available(self, now: float) -> bool:
        return any(s.available(now) for s in self.states.values())

    def known_models(self) -> set[str]:
        models: set[str] = set()
        for state in self.states.values():
            if state.models:
                models |= state.models
        return models

    def engine_adapters(self) -> frozenset[str]:
        """The adapters the backends' ``/v1/models`` list (cards with a parent), as each
        backend's last models probe found them (read per request: no card is walked here)."""
        return frozenset().union(*(s.listed_adapters for s in self.states.values()))

    def model_known(self, model: str | None) -> bool:
        """False only when every backend has told us its models and none serves this one."""
        if model is None:
            return True
        return any(s.models is None or model in s.models for s in self.states.values())

    def acquire_cheap(
        self,
        model: str | None,
        now: float,
        tenant: str = "",
        failed_on: frozenset[str] = frozenset(),
    ) -> BackendState | None:
        """For a tokenizer call: the available backend serving the model with the fewest such
        calls below its own small cap and below the tenant's share of it
        (``proxy.backends.cheap_calls``), passing over those it failed on as ``acquire`` does;
        None when there is none. The generation room is neither checked nor taken."""
        avoid = passed_over(self.states.values(), failed_on, model, now)
        return take_cheap(self.states.values(), model, now, tenant, avoid)

    def release_cheap(self, state: BackendState, tenant: str = "") -> None:
        give_back_cheap(state, tenant)

    # -- bookkeeping ---------------------------------------------------------------------
    def acquire(
        self,
        state: BackendState,
        tokens: float,
        *,
        request: QueuedRequest | None = None,
        best: bool = False,
        reserved: bool = False,
        now: float = 0.0,
    ) -> LoadPlan | None:
        """Count a request in on ``state``: ``best`` of the best tier, ``reserved`` let in
        past the room through the reserve; the adapter load it must do first, if any."""
        state.best_inflight += best
        state.reserve_inflight += reserved
        state.inflight += 1
        state.peak_inflight = max(state.peak_inflight, state.inflight)
        state.tokens_inflight += tokens
        state.best_tokens_inflight += tokens if best else 0.0
        state.relaying_since = None  # vLLM has work again (until a scrape shows otherwise)
        state.dispatched_total += 1
        self.chooser.served(state, request)
        if request is not None and request.prompt_blocks is not None:
            request.predicted_blocks = state.cached_blocks(request.prompt_blocks)
        if request is None:
            return None
        self.token_reservations.release(request)  # sent: its hold, if any, ends now
        wait = (request.arrival_s, request.deadline_s, now)  # as when it was chosen
        user = self.adapter_policy.user(request.tenant, request.tier, best, wait)
        return adapter_begin(state, self.adapters, request.model, self.adapter_policy, user, now)

    def release(
        self,
        state: BackendState,
        tokens: float,
        *,
        best: bool = False,
        request: QueuedRequest | None = None,
        ran: bool | None = True,
        now: float = 0.0,
    ) -> None:
        """Count a request out of ``state``; ``ran`` False: the engine did no work for it
        (the chooser keeps no trace of it: ``BackendChooser.ended``); None: its client left
        before the engine answered."""
        try:  # a chooser that raises must not keep the slot (every backend full at last)
            if request is not None:
                self.chooser.ended(state, request, ran)
        finally:
            if request is not None and request.model in state.adapters.inflight:
                user = self.adapter_policy.user(request.tenant, request.tier, best)
                state.adapters.end(request.model, user, now)
                if state.adapters.claimed is not None and self.on_adapter_claims is not None:
                    self.on_adapter_claims()  # its claim may go back to other replicas
            state.best_inflight -= best
            # Any request leaving brings the backend one nearer its room: one fewer over it.
            state.reserve_inflight = max(0, state.reserve_inflight - 1)
            state.inflight -= 1
            state.tokens_inflight = max(0.0, state.tokens_inflight - tokens)
            state.best_tokens_inflight = max(0.0, state.best_tokens_inflight - best * tokens)
            if state.granted is not None and self.on_shared_room is not None:
                self.on_shared_room(True)
            if state.removed and state.inflight == 0 and self.states.get(state.cfg.url) is state:
                del self.states[state.cfg.url]

    def drain(self, url: str, draining: bool = True) -> BackendState | None:
        """Admin drain: stop new work to a backend and let in-flight work finish."""
        state = self.states.get(url.rstrip("/"))
        if state is not None and not state.removed:
            state.draining = draining
        return state

    # -- health (the state machine is ``proxy.backends.health``) -----------------------
    def record_failure(self, state: BackendState, now: float, *, definitive: bool = False) -> None:
        self.outliers.record_failure(state, now, definitive=definitive)

    def record_success(self, state: BackendState, now: float) -> None:
        self.outliers.record_success(state, now)

    def probe_result(self, state: BackendState, ok: bool, now: float) -> None:
        self.outliers.probe_result(state, ok, now)
