"""One backend as the proxy sees it: its config, what the proxy has in flight there, its health
state and its last scraped load. The pool changes it; the policies read it through
``proxy.policies.types.BackendView``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from proxy.backends.adapter_slots import AdapterSlots
from proxy.backends.clock_offset import correction
from proxy.backends.counts import TenantCounts
from proxy.backends.kvindex import KvIndex
from proxy.config.backends import Backend, BackendHealth
from proxy.config.slo import AdaptiveRoom
from proxy.policies.room import RoomController
from proxy.policies.types import ScrapedLoad


@dataclass(eq=False)
class BackendState:
    cfg: Backend
    inflight: int = 0
    tokens_inflight: float = 0.0
    best_tokens_inflight: float = 0.0  # of those, the best tier's
    healthy: bool = True  # optimistic until a probe or a request says otherwise
    ejected_until: float = 0.0
    failures: int = 0  # consecutive request failures
    failing_since: float | None = None  # the first of them (None: the last request succeeded)
    probe_failures: int = 0  # consecutive failed /health probes
    probe_failing_since: float | None = None  # the first of them (None: the last one passed)
    reinstated_at: float | None = None
    draining: bool = False  # gets no new work; in-flight work finishes
    removed: bool = False  # left the config: dropped once idle
    models: frozenset[str] | None = None  # None: not known yet, accept any
    model_cards: tuple[dict[str, object], ...] = ()  # its /v1/models cards, as last probed
    listed_adapters: frozenset[str] = frozenset()  # those of the cards with a parent
    load: ScrapedLoad | None = None
    # Since when vLLM's scrapes show none of the requests the proxy counts here running or
    # queued (done, still streaming out to their clients); None: it runs some, or none counted.
    relaying_since: float | None = None
    dispatched_total: int = 0
    # Slots this process holds when replicas meter the backend together through Redis
    # (proxy.replicas.room); None: this process alone meters it.
    granted: int | None = None
    room_controller: RoomController | None = None  # set by the pool; None: max_inflight fixed
    peak_inflight: int = 0  # since the room controller's last look
    # Of ``inflight``: the best tier's requests, and how many requests it runs past its room
    # (let in through the best-tier reserve: BackendPool.reserve_room; each request leaving
    # brings it one nearer the room).
    best_inflight: int = 0
    reserve_inflight: int = 0
    # Tokenizer calls (/tokenize, /detokenize) running here: bounded apart from the generation
    # room (cfg.max_cheap_inflight), so they never take a slot a generation waits for.
    cheap_inflight: int = 0
    cheap_by_tenant: TenantCounts = field(default_factory=TenantCounts)  # of those, per tenant
    # Its clock minus ours, from its Date header (proxy.backends.clock_offset); None: unknown.
    clock_offset_s: float | None = None
    # What its prefix cache holds, from its KV events (proxy.backends.kvevents); None: not
    # watched (no KV events configured, or its subscriber has not started).
    kv_index: KvIndex | None = None
    # Its LoRA adapters: held, loading, in flight (proxy.backends.adapter_slots).
    adapters: AdapterSlots = field(default_factory=AdapterSlots)

    @property
    def cheap_tenant_share(self) -> int:
        """Tokenizer calls one tenant may run here at once: half the cap, rounded up."""
        return (self.cfg.max_cheap_inflight + 1) // 2

    @property
    def ticket_time_correction(self) -> float:
        """Seconds to add to this host's time for a ticket's issued_at on the backend's clock."""
        return correction(self.clock_offset_s) if self.clock_offset_s is not None else 0.0

    @property
    def max_room(self) -> float:
        """Requests this backend may hold at once now (before ramps and vLLM's queue)."""
        if self.room_controller is not None:
            return self.room_controller.limit()
        return float(self.cfg.max_inflight or AdaptiveRoom().initial_room)

    def in_transit(self, load: ScrapedLoad | None) -> float:
        """Requests in flight here that vLLM's scheduler does not hold at ``load``'s scrape:
        in its API server on their way in, or done and still streaming out (0 without one)."""
        if load is None:
            return 0.0
        return max(0.0, self.inflight - load.running - load.waiting)

    @property
    def label(self) -> str:
        return self.cfg.label

    def serves(self, model: str | None) -> bool:
        return model is None or self.models is None or model in self.models

    def fits_tokens(self, tokens: float, *, best: bool = False) -> bool:
        """Whether ``tokens`` more fit its ``max_tokens_inflight``. A request larger than the
        whole budget still runs when the backend is idle (its token reservation brings that
        about under load: ``proxy.policies.token_reservations``). ``best``: a best-tier request
        that may take the reserve counts the best tier's tokens only: the vLLM plugin preempts
        worse tiers' for it, as for a reserve slot (a worse tier's request past the whole budget
        shut every tier out while it ran: red team, stop 51)."""
        budget = self.cfg.max_tokens_inflight
        held = self.best_tokens_inflight if best else self.tokens_inflight
        return budget is None or held == 0 or held + tokens <= budget

    def scraped(self, load: ScrapedLoad) -> None:
        """A new scrape of vLLM's load."""
        self.load = load
        if self.inflight == 0 or load.running + load.waiting > 0:
            self.relaying_since = None
        elif self.relaying_since is None:
            self.relaying_since = load.at

    def relays_only(self, now: float, health: BackendHealth) -> bool:
        """Whether, for two scrapes and more, vLLM has run nothing the proxy counts here: what
        it counts is done and streams out to clients (one that stopped reading keeps its slot
        and tokens until ``relay.send_idle_timeout_s`` cuts it), or, rarely, is still on its way
        in (a prompt vLLM's API server takes long to tokenize), and no drain makes room."""
        since, load = self.relaying_since, self.load
        if since is None or load is None or self.inflight == 0:
            return False
        fresh = now - load.at <= health.stale_after_s
        return fresh and now - since >= 2 * health.metrics_interval_s

    def available(self, now: float) -> bool:
        return self.healthy and not self.draining and now >= self.ejected_until

    def fresh_load(self, now: float, stale_after_s: float) -> ScrapedLoad | None:
        if self.load is None or now - self.load.at > stale_after_s:
            return None
        return self.load

    def cached_blocks(self, blocks: Sequence[int]) -> int | None:
        """Leading blocks of ``blocks`` its prefix cache holds; None: no index, or a cold one."""
        index = self.kv_index
        if index is None or not index.warm():
            return None
        return index.leading(blocks)
