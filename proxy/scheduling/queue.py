"""Tier queues: caps, wait deadlines, removal, and the dequeue order. Pure logic, no I/O.

Times are plain floats from the caller's clock (``time.monotonic`` in the server, a fake in
tests). The order comes from the policies (``proxy.policies``), known here only by their
Protocols. Every operation is O(log n) in the number of queued requests and tenants: the
policies keep their backlogged tenants in heaps, and the queue tells them each change.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from proxy.policies.backlog import TenantBacklog
from proxy.policies.displacement import Displacement
from proxy.policies.order import RequestOrder
from proxy.policies.tenants import TenantFairness
from proxy.policies.tiers import TierSelector
from proxy.policies.types import QueuedRequest, State, TierLimits
from proxy.scheduling.queue_heads import HeadModels


@dataclass
class QueuePolicies:
    tiers: TierSelector
    tenants: TenantFairness
    order: RequestOrder
    displacement: Displacement


class QueueFull(Exception):
    def __init__(self, tier: str, depth: int, *, displaced: bool = False) -> None:
        super().__init__(f"tier {tier!r} queue is full ({depth})")
        self.tier = tier
        self.depth = depth
        self.displaced = displaced  # it had been queued, then made room for a smaller tenant


class UnknownTier(KeyError):
    pass


_Entry = tuple[float, int, QueuedRequest]


class _TenantQueue:
    """One tenant's requests in one tier. Entries of requests that left are dropped lazily
    (they leave within the queue timeout, and all of it goes when the tenant empties)."""

    __slots__ = ("by_arrival", "by_key", "depth", "pushed", "since")

    def __init__(self, since: int) -> None:
        self.by_key: list[_Entry] = []  # the order policy's heap
        self.by_arrival: list[_Entry] = []  # to find the one waiting longest
        self.pushed: deque[QueuedRequest] = deque()  # push order, to find the newest
        self.depth = 0
        self.since = since

    def head(self) -> QueuedRequest:
        heap = self.by_key
        while heap[0][2].state is not State.QUEUED:
            heapq.heappop(heap)
        return heap[0][2]

    def backlog(self) -> TenantBacklog:
        by_arrival, pushed = self.by_arrival, self.pushed
        while by_arrival[0][2].state is not State.QUEUED:
            heapq.heappop(by_arrival)
        while pushed[-1].state is not State.QUEUED:
            pushed.pop()
        return TenantBacklog(self.depth, pushed[-1].tenant_weight, by_arrival[0][2], self.since)


class AdmissionQueue:
    def __init__(self, tiers: Mapping[str, TierLimits], policies: QueuePolicies) -> None:
        self._limits = dict(tiers)
        # Per tier: admitted requests waiting for their tenant's rate limit, outside the queue
        # but holding their bodies like queued ones, so they count against the tier's cap.
        self._limit_waiting: Counter[str] = Counter()
        self._seq = itertools.count()
        self._deadlines: list[_Entry] = []
        self._set_policies(policies)

    @property
    def policies(self) -> QueuePolicies:
        return self._policies

    @property
    def selector(self) -> TierSelector:
        return self._policies.tiers

    @property
    def fairness(self) -> TenantFairness:
        return self._policies.tenants

    # -- configuration -------------------------------------------------------------------
    def reconfigure(
        self, tiers: Mapping[str, TierLimits], *, order: RequestOrder | None = None
    ) -> None:
        """New limits and weights (and an order for new arrivals); a tier that disappeared
        keeps draining what it holds."""
        for tier in list(self._limits):
            if tier not in tiers and self._tier_depth.get(tier, 0) == 0:
                del self._limits[tier]
                self._tenants.pop(tier, None)
                self._tier_depth.pop(tier, None)
        self._limits.update(tiers)
        for tier in tiers:
            self._tenants.setdefault(tier, {})
            self._tier_depth.setdefault(tier, 0)
        if order is not None:
            self._policies.order = order
        self.selector.set_tiers(self._limits)

    def replace_policies(self, policies: QueuePolicies) -> None:
        """Switch to other policies, keeping every queued request with its deadline: they are
        re-keyed and re-inserted in push order; the new policies start with no history."""
        queued = sorted(self.queued(), key=lambda r: r.seq)
        self._set_policies(policies)
        for req in queued:
            req.key = policies.order.key(req)
            self._insert(req)

    def limits(self, tier: str) -> TierLimits:
        try:
            return self._limits[tier]
        except KeyError:
            raise UnknownTier(tier) from None

    # -- sizes ---------------------------------------------------------------------------
    def depth(self, tier: str) -> int:
        return self._tier_depth.get(tier, 0)

    def limit_waiting(self, tier: str) -> int:
        return self._limit_waiting[tier]

    def begin_limit_wait(self, tier: str) -> bool:
        """A request of ``tier`` starts waiting for its tenant's limit; False (and nothing
        counted) when the tier's queue and limit waiters already fill its cap."""
        if self.depth(tier) + self._limit_waiting[tier] >= self.limits(tier).max_queue:
            return False
        self._limit_waiting[tier] += 1
        return True

    def end_limit_wait(self, tier: str) -> None:
        self._limit_waiting[tier] -= 1
        if not self._limit_waiting[tier]:
            del self._limit_waiting[tier]

    def retry_after(self, tier: str, slots: float) -> float:
        """A rough wait before retrying: the tier's backlog over the ``slots`` that serve it,
        at least a second, at most the tier's queue timeout."""
        try:
            ceiling = self.limits(tier).queue_timeout_s
        except UnknownTier:
            return 1.0
        return max(1.0, min(ceiling, self.depth(tier) / max(1.0, slots)))

    def __len__(self) -> int:
        return sum(self._tier_depth.values())

    def tiers(self) -> list[str]:
        return list(self._limits)

    def backlogged_tenants(self, tier: str) -> list[str]:
        return list(self._tenants.get(tier, ()))

    def tenant_depth(self, tier: str, tenant: str) -> tuple[int, int]:
        """(requests this tenant holds in the tier, tenants holding any there)."""
        tenants = self._tenants.get(tier, {})
        held = tenants.get(tenant)
        return (held.depth if held is not None else 0), len(tenants)

    def tiers_wanting(self, model: str) -> Collection[str]:
        """The tiers in which some tenant's next request is for ``model``."""
        return self._heads.tiers_wanting(model)

    def next_deadline(self) -> float | None:
        deadlines = self._deadlines
        while deadlines and deadlines[0][2].state is not State.QUEUED:
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    # -- changes -------------------------------------------------------------------------
    def push(self, req: QueuedRequest, now: float, *, force: bool = False) -> QueuedRequest | None:
        """Queue a request (``force``: past the cap, for one already admitted once, e.g. on
        failover). A full tier asks the displacement policy for a tenant to make room: that
        tenant's newest request is displaced and returned, for its client to get the 429
        instead. Otherwise QueueFull."""
        limits = self.limits(req.tier)
        displaced = None
        if not force and self._tier_depth[req.tier] >= limits.max_queue:
            displaced = self._displaceable_for(req)
            if displaced is None:
                raise QueueFull(req.tier, self._tier_depth[req.tier])
            self._forget(displaced, State.DISPLACED)
        req.seq = next(self._seq)
        req.key = self._policies.order.key(req)
        req.deadline_s = now + limits.queue_timeout_s
        req.state = State.QUEUED
        self._insert(req)
        return displaced

    def remove(self, req: QueuedRequest) -> bool:
        """Take a still-queued request out (client left); False if it is no longer queued."""
        if req.state is not State.QUEUED:
            return False
        self._forget(req, State.REMOVED)
        return True

    def expire(self, now: float) -> list[QueuedRequest]:
        """Take out every queued request whose wait deadline has passed."""
        expired: list[QueuedRequest] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, req = heapq.heappop(self._deadlines)
            if req.state is State.QUEUED:
                self._forget(req, State.EXPIRED)
                expired.append(req)
        return expired

    def pop(self, accept: Callable[[QueuedRequest], bool] | None = None) -> QueuedRequest | None:
        """The next request by policy among those ``accept`` allows (e.g. a backend serves its
        model and has room for it); charges the policies for it. A tenant whose next request
        ``accept`` refuses is passed over: each costs O(log n), so a pop costs O(k log n) for
        k refused heads (callers keep k small by not popping when no backend has room)."""
        policies = self._policies
        tiers = [t for t, d in self._tier_depth.items() if d > 0]
        while tiers:
            tier = policies.tiers.pick(tiers)
            if tier is None:
                return None
            req = self._pop_from_tier(tier, accept)
            if req is not None:
                policies.tiers.charge(tier)
                policies.tenants.charge(req.tenant, req.cost, req.tenant_weight)
                req.charged += req.cost
                return req
            tiers.remove(tier)
        return None

    def correct_charge(self, req: QueuedRequest, actual_weighted_tokens: float) -> None:
        """Replace the estimates charged at its dispatches (one each: a request retried after
        a backend failed before its first byte was charged again) by what it really used."""
        self.fairness.charge(req.tenant, actual_weighted_tokens - req.charged, req.tenant_weight)
        req.charged = actual_weighted_tokens

    def is_next(self, req: QueuedRequest) -> bool:
        """Whether ``req`` is queued and its tenant's next in its tier (the only one of the
        tenant's requests there that the dequeue order can pick next)."""
        tenant_queue = self._tenants.get(req.tier, {}).get(req.tenant)
        return req.state is State.QUEUED and tenant_queue is not None and tenant_queue.head() is req

    def heads(self) -> Iterable[QueuedRequest]:
        """Each backlogged tenant's next request in each tier."""
        for by_tenant in self._tenants.values():
            for tenant_queue in by_tenant.values():
                yield tenant_queue.head()

    def queued(self, tier: str | None = None) -> Iterable[QueuedRequest]:
        for t, by_tenant in self._tenants.items():
            if tier is not None and t != tier:
                continue
            for tenant_queue in by_tenant.values():
                for _, _, req in tenant_queue.by_key:
                    if req.state is State.QUEUED:
                        yield req

    # -- internals -----------------------------------------------------------------------
    def _set_policies(self, policies: QueuePolicies) -> None:
        self._policies = policies
        policies.tiers.set_tiers(self._limits)
        self._tenants: dict[str, dict[str, _TenantQueue]] = {t: {} for t in self._limits}
        self._tier_depth: dict[str, int] = {t: 0 for t in self._limits}
        self._heads = HeadModels()
        self._deadlines = []

    def _insert(self, req: QueuedRequest) -> None:
        tier = req.tier
        if self._tier_depth[tier] == 0:
            self.selector.activate(tier, [t for t, d in self._tier_depth.items() if d > 0])
        by_tenant = self._tenants[tier]
        tenant_queue = by_tenant.get(req.tenant)
        if tenant_queue is None:
            tenant_queue = by_tenant[req.tenant] = _TenantQueue(since=req.seq)
        entry = (req.key, req.seq, req)
        heapq.heappush(tenant_queue.by_key, entry)
        heapq.heappush(tenant_queue.by_arrival, (req.arrival_s, req.seq, req))
        pushed = tenant_queue.pushed
        while pushed and pushed[0].state is not State.QUEUED:
            pushed.popleft()
        pushed.append(req)
        tenant_queue.depth += 1
        heapq.heappush(self._deadlines, (req.deadline_s, req.seq, req))
        self._tier_depth[tier] += 1
        self._changed(tier, req.tenant, tenant_queue)

    def _displaceable_for(self, req: QueuedRequest) -> QueuedRequest | None:
        """The newest request of the tenant the displacement policy names, if any."""
        mine = self._tenants[req.tier].get(req.tenant)
        victim = self._policies.displacement.victim(req.tier, req, mine.depth if mine else 0)
        if victim is None:
            return None
        pushed = self._tenants[req.tier][victim].pushed
        while pushed[-1].state is not State.QUEUED:
            pushed.pop()
        return pushed.pop()

    def _pop_from_tier(
        self, tier: str, accept: Callable[[QueuedRequest], bool] | None
    ) -> QueuedRequest | None:
        by_tenant = self._tenants[tier]

        def head_accepted(tenant: str) -> bool:
            assert accept is not None
            return accept(by_tenant[tenant].head())

        tenant = self._policies.tenants.pick(tier, head_accepted if accept is not None else None)
        if tenant is None:
            return None
        tenant_queue = by_tenant[tenant]
        req = tenant_queue.head()
        heapq.heappop(tenant_queue.by_key)
        self._forget(req, State.DISPATCHED)
        return req

    def _forget(self, req: QueuedRequest, state: State) -> None:
        req.state = state
        self._tier_depth[req.tier] -= 1
        by_tenant = self._tenants[req.tier]
        tenant_queue = by_tenant[req.tenant]
        tenant_queue.depth -= 1
        if tenant_queue.depth == 0:
            del by_tenant[req.tenant]  # its entries are all stale: memory follows the backlog
            self._changed(req.tier, req.tenant, None)
        else:
            self._changed(req.tier, req.tenant, tenant_queue)

    def _changed(self, tier: str, tenant: str, tenant_queue: _TenantQueue | None) -> None:
        backlog = tenant_queue.backlog() if tenant_queue is not None else None
        head = tenant_queue.head() if tenant_queue is not None else None
        self._heads.set(tier, tenant, head.model if head is not None else None)
        self._policies.tenants.backlog_changed(tier, tenant, backlog)
        self._policies.displacement.backlog_changed(tier, tenant, backlog)
