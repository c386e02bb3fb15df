"""Which tenant of a tier goes next. Each keeps its backlogged tenants in a ``KeyedHeap``, so a
pick, a charge and a backlog change cost O(log n) whatever the number of tenants."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping
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
        # tenant -> {tier where it is backlogged: arrival of its oldest request there}
        self._oldest: dict[str, dict[str, float]] = {}
        self._by_tier: dict[str, KeyedHeap] = {}  # backlogged tenants by (counter, oldest, name)
        # The highest counter, for the lift into an empty tier (rare): changed counters are
        # only noted, and folded into a heap of (-counter, tenant) when asked for.
        self._highest: list[tuple[float, str]] = []
        self._changed: list[str] = []
        # Whose oldest request changed since their heap entry was made. Repositioned at the
        # next pick, unless a charge does it first (a dispatch changes both: one heap push).
        self._moved: set[tuple[str, str]] = set()
        # Service charged here and not yet merged with other replicas' (proxy.replicas.fairness
        # sets it to {}); None: this process is alone.
        self.unsynced: dict[str, float] | None = None

    def counter(self, tenant: str) -> float:
        return self._counter.get(tenant, 0.0)

    def backlog_changed(self, tier: str, tenant: str, backlog: TenantBacklog | None) -> None:
        tiers = self._oldest.get(tenant)
        if backlog is None:
            if tiers is not None and tiers.pop(tier, None) is not None:
                self._by_tier[tier].discard(tenant)
                self._moved.discard((tier, tenant))
                if not tiers:
                    del self._oldest[tenant]
            return
        arrival = backlog.oldest.arrival_s
        if tiers is None:
            tiers = self._oldest[tenant] = {}
        previous = tiers.get(tier)
        tiers[tier] = arrival
        if previous is None:
            heap = self._by_tier.get(tier)
            if heap is None:
                heap = self._by_tier[tier] = KeyedHeap()
            self._flush()
            self._lift(tenant, heap)  # sets its counter, and so its place in this heap
        elif previous != arrival:
            self._moved.add((tier, tenant))

    def pick(self, tier: str, accept: Callable[[str], bool] | None = None) -> str | None:
        heap = self._by_tier.get(tier)
        if heap is None:
            return None
        self._flush()
        found = heap.first(accept)
        return found[-1] if found is not None else None

    def charge(self, tenant: str, weighted: float, tenant_weight: float = 1.0) -> None:
        share = weighted / tenant_weight
        self._set(tenant, self._counter.get(tenant, 0.0) + share)
        if self.unsynced is not None:
            self.unsynced[tenant] = self.unsynced.get(tenant, 0.0) + share

    def absorb(self, counters: Mapping[str, float]) -> None:
        """Take counters merged with other replicas' service as this process's own."""
        for tenant, counter in counters.items():
            if self._counter.get(tenant) != counter:
                self._set(tenant, counter)

    def backlogged(self) -> Iterable[str]:
        """Tenants with something queued here, in any tier."""
        return self._oldest.keys()

    def forget(self, keep: Iterable[str]) -> None:
        # A set as it is: copying 10,000 names on the event loop at each reload costs a lot.
        kept = keep if isinstance(keep, set | frozenset) else set(keep)
        for tenant in [t for t in self._counter if t not in kept]:
            del self._counter[tenant]
            self._reposition(tenant, 0.0)

    def _lift(self, tenant: str, tier_heap: KeyedHeap) -> None:
        lowest = tier_heap.first()
        if lowest is not None:
            floor: float = lowest[0]
        else:
            floor = self._highest_counter()
        self._set(tenant, max(self._counter.get(tenant, 0.0), floor))

    def _set(self, tenant: str, counter: float) -> None:
        self._counter[tenant] = counter
        self._changed.append(tenant)
        if len(self._changed) > len(self._counter) + 64:
            self._rebuild_highest()
        self._reposition(tenant, counter)

    def _reposition(self, tenant: str, counter: float) -> None:
        for tier, oldest in self._oldest.get(tenant, {}).items():
            self._by_tier[tier].set(tenant, (counter, oldest, tenant))
            if self._moved:
                self._moved.discard((tier, tenant))

    def _highest_counter(self) -> float:
        heap, counter = self._highest, self._counter
        for tenant in self._changed:
            if tenant in counter:
                heapq.heappush(heap, (-counter[tenant], tenant))
        self._changed.clear()
        # An entry is stale when its tenant's counter moved since (or was forgotten).
        while heap and counter.get(heap[0][1]) != -heap[0][0]:
            heapq.heappop(heap)
        if len(heap) > 2 * len(counter) + 64:
            self._rebuild_highest()
        return -heap[0][0] if heap else 0.0

    def _rebuild_highest(self) -> None:
        self._highest = [(-c, t) for t, c in self._counter.items()]
        heapq.heapify(self._highest)
        self._changed.clear()

    def _flush(self) -> None:
        while self._moved:
            tier, tenant = self._moved.pop()
            key = (self._counter.get(tenant, 0.0), self._oldest[tenant][tier], tenant)
            self._by_tier[tier].set(tenant, key)


class EarliestDeadlineFirst:
    """No per-tenant fairness: the tenant holding the tier's most urgent request goes next.

    A tenant's urgency is the queue deadline (arrival at the queue + the tier's queue timeout)
    of its longest-waiting request, so across a tier this serves the request closest to timing
    out first, whoever sends it. With ``order: fcfs`` that request is also the one dispatched.
    """

    def __init__(self) -> None:
        self._by_tier: dict[str, KeyedHeap] = {}

    def backlog_changed(self, tier: str, tenant: str, backlog: TenantBacklog | None) -> None:
        heap = self._by_tier.get(tier)
        if heap is None:
            heap = self._by_tier[tier] = KeyedHeap()
        if backlog is None:
            heap.discard(tenant)
        else:
            heap.set(tenant, (backlog.oldest.deadline_s, backlog.oldest.seq))

    def pick(self, tier: str, accept: Callable[[str], bool] | None = None) -> str | None:
        heap = self._by_tier.get(tier)
        found = heap.first(accept) if heap is not None else None
        return found[-1] if found is not None else None

    def charge(self, tenant: str, weighted: float, tenant_weight: float = 1.0) -> None:
        pass

    def forget(self, keep: Iterable[str]) -> None:
        pass
