"""One backend's LoRA adapters as the proxy sees them: which it holds (listed by its
``/v1/models`` or loaded by the proxy), which are in flight, which are being loaded, and when
each was last used. Pure logic, no I/O: ``proxy.backends.adapter_loader`` does the calls.

A backend with ``max_loras`` M never gets a request whose adapter would make more than M
distinct adapters in flight there: vLLM would hold it in its own "deferred" list, out of the
proxy's sight; here it waits in the proxy's queue, in its tier's order. The proxy also keeps at
most M adapters registered on an engine it loads into, unloading the least recently used idle
one to make room, so that every adapter it holds fits vLLM's adapter cache at once. Who may
open a slot, and which idle adapter a request gives up, is ``proxy.backends.adapter_rules``'s
call (tiers and tenants); this module keeps the counts it decides from.

With ``shared_state:`` the bound holds across replicas too: ``claimed`` is the set of adapters
this replica may run on the engine, taken from Redis (``proxy.replicas.adapter_claims``) so
that all live replicas' claims together name at most M distinct adapters; a request for an
adapter not claimed here waits (``wanted``) until the claim is granted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

Fit = Literal["has", "load"]


@dataclass(frozen=True)
class SlotUser:
    """Who a request for an adapter is for: its tenant, whether its tier is the best, its
    tier's rank (its ``priority``: lower is better), and until when it would rather wait than
    give up an idle adapter that a waiting request of its tier or a better one wants."""

    tenant: str = ""
    best: bool = True
    rank: int = 0
    patient_until: float = float("-inf")
    due: bool = False  # it waited its tier's share of its queue timeout (rules: "Due")


def _no_demand(adapter: str) -> int | None:
    return None


@dataclass(frozen=True)
class LoadPlan:
    """What the request that took the slot must do before it is forwarded: load ``load``,
    after unloading ``unload`` (None: nothing to unload); for ``tenant``, and whether the
    adapter it gives up is one another tenant claims (``others``)."""

    load: str
    unload: str | None = None
    tenant: str = field(default="", compare=False)
    others: bool = field(default=False, compare=False)


@dataclass
class AdapterSlots:
    held: dict[str, float] = field(default_factory=dict)  # name -> last used (monotonic)
    loading: set[str] = field(default_factory=set)  # held, but the proxy's load is under way
    # given up (name -> when last used): never routed to, never re-listed while the unload runs
    unloading: dict[str, float] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)  # name -> requests in flight
    # name -> tenant -> (when its requests last used it, its tier's rank): every tenant that
    # used a held adapter, each its own claim (held names only; none: listed only). One map per
    # tenant, not one last user: a tenant touching another's shared adapter once must not take
    # over its claim (red team F5).
    users: dict[str, dict[str, tuple[float, int]]] = field(default_factory=dict)
    # tenant -> name -> its requests in flight; name -> requests of worse tiers in flight.
    by_tenant: dict[str, dict[str, int]] = field(default_factory=dict)
    worse: dict[str, int] = field(default_factory=dict)
    # (tenant, of the best tier) of the requests that found no slot anywhere in this dispatch
    # pass and wait for one here (cleared at each pass: nothing stale when they leave).
    waiting: set[tuple[str, bool]] = field(default_factory=set)
    due_waiting: set[str] = field(default_factory=set)  # the tenants of due ones among them
    # Shared with other replicas: the adapters this replica may run here (None: it counts
    # alone, no shared state or Redis down), those its requests wait to claim (seen anew at
    # each dispatch pass), and those other replicas claimed here at the last look (given up
    # here last: another replica may be running them).
    claimed: set[str] | None = None
    wanted: set[str] = field(default_factory=set)
    fresh: set[str] = field(default_factory=set)  # claimed since the last pass: kept till it
    elsewhere: frozenset[str] = frozenset()
    # The best tier rank among the queue's next requests (each tenant's head) that want an
    # adapter (None: none does), given by the dispatcher at each pass; and the earliest end of
    # a request's patience with such an adapter in this pass (when to look again).
    demand: Callable[[str], int | None] = _no_demand
    patience_ends: float | None = None

    def new_pass(self, demand: Callable[[str], int | None] | None = None) -> None:
        """A dispatch pass begins: who waits for a slot or a claim here is seen anew, and
        (``demand``) which adapters the queue's next requests want."""
        self.waiting.clear()
        self.due_waiting.clear()
        self.wanted.clear()
        self.fresh.clear()
        self.patience_ends = None
        if demand is not None:
            self.demand = demand

    def patient(self, until: float) -> None:
        """A request in this pass waits, until ``until``, rather than give up a wanted adapter."""
        if self.patience_ends is None or until < self.patience_ends:
            self.patience_ends = until

    def may_run(self, adapter: str) -> bool:
        """Shared with other replicas: ``adapter`` is claimed here (else it is noted as wanted
        and its request waits). Counting alone: always."""
        if self.claimed is None or adapter in self.claimed:
            return True
        self.wanted.add(adapter)
        return False

    def running(self) -> set[str]:
        return {name for name, count in self.inflight.items() if count > 0}

    def running_of(self, tenant: str) -> set[str]:
        return set(self.by_tenant.get(tenant, ()))

    def worse_running(self) -> set[str]:
        return set(self.worse)

    def claims(self, now: float, claim_s: float) -> dict[str, dict[str, int]]:
        """Held adapters still wanted (name -> tenant -> its tier's rank): by each tenant that
        runs a request on it, or used it within ``claim_s``."""
        found: dict[str, dict[str, int]] = {}
        for name, by in self.users.items():
            for tenant, (at, rank) in list(by.items()):
                if at >= now - claim_s or name in self.by_tenant.get(tenant, ()):
                    found.setdefault(name, {})[tenant] = rank
                else:  # lapsed: forgotten (else every tenant that ever used it stays here)
                    del by[tenant]
        return found

    def idle(self) -> list[tuple[float, str]]:
        """(last used, name) of the adapters held here with nothing in flight, not loading."""
        running = self.running()
        return [(t, n) for n, t in self.held.items() if n not in running and n not in self.loading]

    def listed(self, names: frozenset[str], now: float) -> None:
        """The adapters its ``/v1/models`` lists now (those the proxy is loading stay)."""
        keep = {n: t for n, t in self.held.items() if n in names or n in self.loading}
        for name in names - self.unloading.keys():
            keep.setdefault(name, now)
        self.held = keep
        self.users = {n: by for n, by in self.users.items() if n in keep}

    def begin(
        self, adapter: str, user: SlotUser, unload: str | None, now: float, others: bool = False
    ) -> LoadPlan | None:
        """Count a request of ``user`` for ``adapter`` in; the load it must do first (None:
        held), giving up ``unload`` (the rules' pick) when the slots are full."""
        self.inflight[adapter] = self.inflight.get(adapter, 0) + 1
        mine = self.by_tenant.setdefault(user.tenant, {})
        mine[adapter] = mine.get(adapter, 0) + 1
        if not user.best:
            self.worse[adapter] = self.worse.get(adapter, 0) + 1
        self._used(adapter, user, now)
        if adapter in self.held:
            self.held[adapter] = now
            return None
        if unload is not None:
            self.unloading[unload] = self.held.pop(unload)
            self.users.pop(unload, None)
        self.held[adapter] = now
        self.loading.add(adapter)
        return LoadPlan(adapter, unload, user.tenant, others)

    def end(self, adapter: str, user: SlotUser, now: float) -> None:
        """A request of ``user`` for ``adapter`` left."""
        _count_out(self.inflight, adapter)
        mine = self.by_tenant.get(user.tenant)
        if mine is not None:
            _count_out(mine, adapter)
            if not mine:
                del self.by_tenant[user.tenant]
        if not user.best:
            _count_out(self.worse, adapter)
        if adapter in self.held:
            self.held[adapter] = now
            self._used(adapter, user, now)

    def _used(self, adapter: str, user: SlotUser, now: float) -> None:
        self.users.setdefault(adapter, {})[user.tenant] = (now, user.rank)

    def load_done(self, adapter: str, ok: bool) -> None:
        self.loading.discard(adapter)
        if not ok:
            self.held.pop(adapter, None)
            self.users.pop(adapter, None)

    def unload_done(self, adapter: str, ok: bool = True) -> None:
        """The unload of ``adapter`` ended; not ``ok`` (refused, timed out, no answer): it is
        counted as held again, as used when it was given up, so that the engine is never
        counted below what it may hold (red team F2 of round g: a timed-out unload counted
        as done let a third adapter onto a two-slot engine); the next ``/v1/models`` or a
        later unload says otherwise."""
        last = self.unloading.pop(adapter, None)
        if not ok and last is not None:
            self.held.setdefault(adapter, last)

    def gone(self, adapter: str) -> bool:
        """The engine said it does not know ``adapter`` (404): no longer held there, so that
        the next request for it loads it again (a restarted engine, or another replica's
        unload) rather than meet the same 404 until the next ``/v1/models`` probe. True when
        it was counted as held."""
        if adapter in self.loading:
            return False
        self.users.pop(adapter, None)
        return self.held.pop(adapter, None) is not None

    def cancel(self, plan: LoadPlan) -> None:
        """The request that was to carry out ``plan`` left before it began: nothing was loaded
        nor unloaded (the adapter it would have given up is held again, as the oldest)."""
        self.load_done(plan.load, ok=False)
        if plan.unload is not None and plan.unload in self.unloading:
            self.unloading.pop(plan.unload)
            self.held.setdefault(plan.unload, float("-inf"))


def _count_out(counts: dict[str, int], name: str) -> None:
    count = counts.get(name, 0) - 1
    if count > 0:
        counts[name] = count
    else:
        counts.pop(name, None)
