"""Tier queues: caps, wait deadlines, removal, and the dequeue order. Pure logic, no I/O.

Times are plain floats from the caller's clock (``time.monotonic`` in the server, a fake in
tests). The order comes from the policy objects in ``proxy.policy``.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from proxy.policy import VirtualTokenCounter, WeightedTierSelector, short_first_key, weighted_tokens


class State(Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    REMOVED = "removed"  # the client left or the handler gave up
    EXPIRED = "expired"  # waited past its tier's queue timeout
    DISPLACED = "displaced"  # pushed out of a full tier by a tenant with a smaller share


@dataclass(frozen=True)
class TierLimits:
    weight: float
    max_queue: int
    queue_timeout_s: float


@dataclass(eq=False)
class QueuedRequest:
    tier: str
    tenant: str
    prompt_tokens: int
    expected_output: int
    arrival_s: float
    model: str | None = None
    tenant_weight: float = 1.0
    # Set by the queue.
    deadline_s: float = 0.0
    state: State = State.QUEUED
    seq: int = -1
    key: float = 0.0
    # The mechanism's handle (a future in the server); the queue never looks at it.
    waiter: Any = field(default=None, repr=False)

    @property
    def cost(self) -> float:
        return weighted_tokens(self.prompt_tokens, self.expected_output)


class QueueFull(Exception):
    def __init__(self, tier: str, depth: int, *, displaced: bool = False) -> None:
        super().__init__(f"tier {tier!r} queue is full ({depth})")
        self.tier = tier
        self.depth = depth
        self.displaced = displaced  # it had been queued, then made room for a smaller tenant


class UnknownTier(KeyError):
    pass


_Entry = tuple[float, int, QueuedRequest]


class AdmissionQueue:
    def __init__(
        self,
        tiers: Mapping[str, TierLimits],
        *,
        aging_s: float,
        reference_tokens: float,
        tier_selector: WeightedTierSelector | None = None,
        fairness: VirtualTokenCounter | None = None,
    ) -> None:
        self._limits = dict(tiers)
        self.aging_s = aging_s
        self.reference_tokens = reference_tokens
        self.selector = tier_selector or WeightedTierSelector(
            {t: lim.weight for t, lim in tiers.items()}
        )
        self.fairness = fairness or VirtualTokenCounter()
        self._seq = itertools.count()
        # tier -> tenant -> heap of (key, seq, request); removed entries are dropped lazily.
        self._heaps: dict[str, dict[str, list[_Entry]]] = {t: {} for t in tiers}
        self._tenant_depth: dict[tuple[str, str], int] = {}
        # (tier, tenant) -> its requests in arrival order, to find its newest; stale entries
        # are dropped lazily (a request leaves within its queue timeout, so this stays bounded).
        self._arrivals: dict[tuple[str, str], deque[QueuedRequest]] = {}
        self._tier_depth: dict[str, int] = {t: 0 for t in tiers}
        self._deadlines: list[tuple[float, int, QueuedRequest]] = []

    # -- configuration -------------------------------------------------------------------
    def reconfigure(
        self, tiers: Mapping[str, TierLimits], *, aging_s: float, reference_tokens: float
    ) -> None:
        """New limits and weights; a tier that disappeared keeps draining what it holds."""
        for tier in list(self._limits):
            if tier not in tiers and self._tier_depth.get(tier, 0) == 0:
                del self._limits[tier]
                self._heaps.pop(tier, None)
                self._tier_depth.pop(tier, None)
        self._limits.update(tiers)
        for tier in tiers:
            self._heaps.setdefault(tier, {})
            self._tier_depth.setdefault(tier, 0)
        self.aging_s = aging_s
        self.reference_tokens = reference_tokens
        self.selector.set_weights({t: lim.weight for t, lim in self._limits.items()})

    def limits(self, tier: str) -> TierLimits:
        try:
            return self._limits[tier]
        except KeyError:
            raise UnknownTier(tier) from None

    # -- sizes ---------------------------------------------------------------------------
    def depth(self, tier: str) -> int:
        return self._tier_depth.get(tier, 0)

    def __len__(self) -> int:
        return sum(self._tier_depth.values())

    def tiers(self) -> list[str]:
        return list(self._limits)

    def backlogged_tenants(self, tier: str) -> list[str]:
        return [n for (t, n), d in self._tenant_depth.items() if t == tier and d > 0]

    def next_deadline(self) -> float | None:
        self._drop_stale_deadlines()
        return self._deadlines[0][0] if self._deadlines else None

    # -- changes -------------------------------------------------------------------------
    def push(
        self, req: QueuedRequest, now: float, *, force: bool = False
    ) -> QueuedRequest | None:
        """Queue a request (``force``: past the cap, for one already admitted once, e.g. on
        failover).

        A full tier makes room when one tenant holds a bigger share of it (queued requests
        over tenant weight) than the newcomer's tenant would: that tenant's newest request
        is displaced and returned, for its client to get the 429 instead (longest-queue
        drop), so that a flooding tenant cannot lock the others out of their tier. Otherwise
        QueueFull."""
        limits = self.limits(req.tier)
        depth = self._tier_depth[req.tier]
        displaced = None
        if not force and depth >= limits.max_queue:
            displaced = self._displaceable_for(req)
            if displaced is None:
                raise QueueFull(req.tier, depth)
            self._forget(displaced, State.DISPLACED)
            depth -= 1
        req.seq = next(self._seq)
        req.key = short_first_key(
            req.cost, req.arrival_s, reference_tokens=self.reference_tokens, aging_s=self.aging_s
        )
        req.deadline_s = now + limits.queue_timeout_s
        req.state = State.QUEUED
        if depth == 0:
            self.selector.activate(req.tier, [t for t, d in self._tier_depth.items() if d > 0])
        tenant_key = (req.tier, req.tenant)
        if self._tenant_depth.get(tenant_key, 0) == 0:
            self.fairness.activate(req.tenant, self.backlogged_tenants(req.tier))
        heapq.heappush(self._heaps[req.tier].setdefault(req.tenant, []), (req.key, req.seq, req))
        heapq.heappush(self._deadlines, (req.deadline_s, req.seq, req))
        arrivals = self._arrivals.setdefault(tenant_key, deque())
        while arrivals and arrivals[0].state is not State.QUEUED:
            arrivals.popleft()
        arrivals.append(req)
        self._tier_depth[req.tier] = depth + 1
        self._tenant_depth[tenant_key] = self._tenant_depth.get(tenant_key, 0) + 1
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
        model and has room for it); charges the policies for it."""
        tiers = {t for t, d in self._tier_depth.items() if d > 0}
        while tiers:
            tier = self.selector.pick(tiers)
            if tier is None:
                return None
            req = self._pop_from_tier(tier, accept)
            if req is not None:
                self.selector.charge(tier)
                self.fairness.charge(req.tenant, req.cost, req.tenant_weight)
                return req
            tiers.discard(tier)
        return None

    def correct_charge(self, req: QueuedRequest, actual_weighted_tokens: float) -> None:
        """Replace the estimate charged at dispatch by what the request really used."""
        self.fairness.charge(req.tenant, actual_weighted_tokens - req.cost, req.tenant_weight)

    def queued(self, tier: str | None = None) -> Iterable[QueuedRequest]:
        for t, by_tenant in self._heaps.items():
            if tier is not None and t != tier:
                continue
            for heap in by_tenant.values():
                for _, _, req in heap:
                    if req.state is State.QUEUED:
                        yield req

    # -- internals -----------------------------------------------------------------------
    def _displaceable_for(self, req: QueuedRequest) -> QueuedRequest | None:
        """The newest request of the tenant holding the largest weighted share of the tier,
        if that share, less that request, is still at least what the newcomer's tenant would
        hold with one more."""
        mine = self._tenant_depth.get((req.tier, req.tenant), 0) + 1
        my_share = mine / req.tenant_weight
        best: tuple[float, deque[QueuedRequest]] | None = None
        for (tier, tenant), depth in self._tenant_depth.items():
            if tier != req.tier or tenant == req.tenant or depth == 0:
                continue
            arrivals = self._arrivals[(tier, tenant)]
            while arrivals[-1].state is not State.QUEUED:
                arrivals.pop()
            # Compared after losing one: a swap never just reverses the imbalance (ping-pong).
            share = (depth - 1) / arrivals[-1].tenant_weight
            if share >= my_share and (best is None or share > best[0]):
                best = (share, arrivals)
        return best[1].pop() if best is not None else None

    def _pop_from_tier(
        self, tier: str, accept: Callable[[QueuedRequest], bool] | None
    ) -> QueuedRequest | None:
        tenants = set(self.backlogged_tenants(tier))
        while tenants:
            tenant = self.fairness.pick(tenants)
            if tenant is None:
                return None
            heap = self._heaps[tier][tenant]
            while heap and heap[0][2].state is not State.QUEUED:
                heapq.heappop(heap)
            head = heap[0][2]
            if accept is None or accept(head):
                heapq.heappop(heap)
                self._forget(head, State.DISPATCHED)
                return head
            tenants.discard(tenant)
        return None

    def _forget(self, req: QueuedRequest, state: State) -> None:
        req.state = state
        self._tier_depth[req.tier] -= 1
        tenant_key = (req.tier, req.tenant)
        self._tenant_depth[tenant_key] -= 1
        if self._tenant_depth[tenant_key] == 0:
            del self._tenant_depth[tenant_key]
            # The heap holds only stale entries now; drop it so memory follows the backlog.
            self._heaps[req.tier].pop(req.tenant, None)
            self._arrivals.pop(tenant_key, None)

    def _drop_stale_deadlines(self) -> None:
        while self._deadlines and self._deadlines[0][2].state is not State.QUEUED:
            heapq.heappop(self._deadlines)
