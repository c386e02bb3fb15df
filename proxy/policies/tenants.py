"""Which tenant of a tier goes next. Each keeps its backlogged tenants in a ``KeyedHeap``, so a
pick, a charge and a backlog change cost O(log n) whatever the number of tenants."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from proxy.policies.backlog import BacklogObserver, KeyedHeap, TenantBacklog


class TenantFairness(BacklogObserver, Protocol):
    def pick(self, tier: str, accept: Callable[[str], bool] | None = None) -> str | None:
        """The tenant to serve next in ``tier`` among the backlogged ones ``accept`` allows."""

    def charge(self, tenant: str, weighted: float, tenant_weight: float = 1.0) -> None:
        """Service given to a tenant (negative: a correction of an estimate)."""

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the history of tenants that are no longer configured."""


class VirtualTokenCounter:
    """Fair share across tenants by weighted tokens served, divided by the tenant's weight.

    The tenant with the least service so far goes next; on a tie, the one whose oldest queued
    request has waited longest (then the name). Estimated tokens are charged at dispatch and
    corrected with the real usage when the request ends. A tenant returning from idle is lifted
    to the minimum counter among the tier's backlogged tenants (the highest counter of all when
    none is), so it cannot claim its idle time back. Counters are per tenant, across tiers.
    """

    def __init__(self) -> None:
        self._counter: dict[str, float] = {}
        self._by_tier: dict[str, KeyedHeap] = {}  # backlogged tenants by (counter, oldest, name)
        self._oldest: dict[tuple[str, str], float] = {}  # (tier, tenant) -> oldest arrival
        self._tiers_of: dict[str, set[str]] = {}  # tenant -> tiers where it is backlogged
        self._highest = KeyedHeap()  # every counter, by (-counter, name): the idle lift's floor

    def counter(self, tenant: str) -> float:
        return self._counter.get(tenant, 0.0)

    def backlog_changed(self, tier: str, tenant: str, backlog: TenantBacklog | None) -> None:
        heap = self._by_tier.setdefault(tier, KeyedHeap())
        if backlog is None:
            heap.discard(tenant)
            self._oldest.pop((tier, tenant), None)
            tiers = self._tiers_of.get(tenant)
            if tiers is not None:
                tiers.discard(tier)
                if not tiers:
                    del self._tiers_of[tenant]
            return
        arrival = backlog.oldest.arrival_s
        if tenant not in heap:
            self._lift(tenant, heap)
            self._tiers_of.setdefault(tenant, set()).add(tier)
        elif self._oldest[(tier, tenant)] == arrival:
            return
        self._oldest[(tier, tenant)] = arrival
        heap.set(tenant, (self._counter.get(tenant, 0.0), arrival, tenant))

    def pick(self, tier: str, accept: Callable[[str], bool] | None = None) -> str | None:
        heap = self._by_tier.get(tier)
        found = heap.first(accept) if heap is not None else None
        return found[1] if found is not None else None

    def charge(self, tenant: str, weighted: float, tenant_weight: float = 1.0) -> None:
        self._set(tenant, self._counter.get(tenant, 0.0) + weighted / tenant_weight)

    def forget(self, keep: Iterable[str]) -> None:
        kept = set(keep)
        for tenant in [t for t in self._counter if t not in kept]:
            del self._counter[tenant]
            self._highest.discard(tenant)
            self._reposition(tenant, 0.0)

    def _lift(self, tenant: str, tier_heap: KeyedHeap) -> None:
        lowest = tier_heap.first()
        if lowest is not None:
            floor: float = lowest[0][0]
        else:
            highest = self._highest.first()
            floor = -highest[0][0] if highest is not None else 0.0
        self._set(tenant, max(self._counter.get(tenant, 0.0), floor))

    def _set(self, tenant: str, counter: float) -> None:
        self._counter[tenant] = counter
        self._highest.set(tenant, (-counter, tenant))
        self._reposition(tenant, counter)

    def _reposition(self, tenant: str, counter: float) -> None:
        for tier in self._tiers_of.get(tenant, ()):
            oldest = self._oldest[(tier, tenant)]
            self._by_tier[tier].set(tenant, (counter, oldest, tenant))


class EarliestDeadlineFirst:
    """No per-tenant fairness: the tenant holding the tier's most urgent request goes next.

    A tenant's urgency is the queue deadline (arrival at the queue + the tier's queue timeout)
    of its longest-waiting request, so across a tier this serves the request closest to timing
    out first, whoever sends it. With ``order: fcfs`` that request is also the one dispatched.
    """

    def __init__(self) -> None:
        self._by_tier: dict[str, KeyedHeap] = {}

    def backlog_changed(self, tier: str, tenant: str, backlog: TenantBacklog | None) -> None:
        heap = self._by_tier.setdefault(tier, KeyedHeap())
        if backlog is None:
            heap.discard(tenant)
        else:
            heap.set(tenant, (backlog.oldest.deadline_s, backlog.oldest.seq))

    def pick(self, tier: str, accept: Callable[[str], bool] | None = None) -> str | None:
        heap = self._by_tier.get(tier)
        found = heap.first(accept) if heap is not None else None
        return found[1] if found is not None else None

    def charge(self, tenant: str, weighted: float, tenant_weight: float = 1.0) -> None:
        pass

    def forget(self, keep: Iterable[str]) -> None:
        pass
