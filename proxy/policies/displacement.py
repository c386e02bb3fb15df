"""What a full tier does with a newcomer: name a tenant whose newest request makes room (the
queue displaces it; its client gets the 429), or None to refuse the newcomer."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

from proxy.policies.backlog import BacklogObserver, TenantBacklog

if TYPE_CHECKING:
    from proxy.policies.types import QueuedRequest


class Displacement(BacklogObserver, Protocol):
    def victim(self, tier: str, newcomer: QueuedRequest, newcomer_depth: int) -> str | None:
        """The tenant to lose its newest request so that ``newcomer`` gets in; ``newcomer_depth``:
        what the newcomer's tenant already has queued in the tier."""


class LargestShare:
    """The tenant holding the largest weighted share of the tier (queued requests over tenant
    weight; ties: the one that reached that share first), if that share, less the request it
    loses, is still at least what the newcomer's tenant would hold with one more. Compared
    after losing one, so that a swap never just reverses the imbalance (ping-pong).
    Longest-queue drop: a flooding tenant cannot lock the others out of their tier.

    Tenants are kept in buckets by (weight, depth): a depth changes by one per event, so each
    event and each query cost O(1) per distinct tenant weight, with no heap to clean.
    """

    def __init__(self) -> None:
        self._by_tier: dict[str, _Shares] = {}

    def backlog_changed(self, tier: str, tenant: str, backlog: TenantBacklog | None) -> None:
        shares = self._by_tier.get(tier)
        if shares is None:
            shares = self._by_tier[tier] = _Shares()
        shares.update(tenant, None if backlog is None else (backlog.weight, backlog.depth))

    def victim(self, tier: str, newcomer: QueuedRequest, newcomer_depth: int) -> str | None:
        shares = self._by_tier.get(tier)
        best = shares.largest(excluding=newcomer.tenant) if shares is not None else None
        if best is None:
            return None
        share, tenant = best
        return tenant if share >= (newcomer_depth + 1) / newcomer.tenant_weight else None


class _Shares:
    """The backlogged tenants of one tier by weight, then depth; inside a bucket in the order
    they entered it."""

    def __init__(self) -> None:
        self._place: dict[str, tuple[float, int]] = {}  # tenant -> (weight, depth)
        self._buckets: dict[float, dict[int, OrderedDict[str, int]]] = {}  # -> tenant: stamp
        self._top: dict[float, int] = {}  # weight -> deepest non-empty depth
        self._stamp = itertools.count()

    def update(self, tenant: str, place: tuple[float, int] | None) -> None:
        old = self._place.get(tenant)
        if old == place:
            return
        if place is not None:  # enter the new bucket first, so leaving finds the top at once
            self._place[tenant] = place
            weight, depth = place
            by_depth = self._buckets.get(weight)
            if by_depth is None:
                by_depth = self._buckets[weight] = {}
                self._top[weight] = depth
            bucket = by_depth.get(depth)
            if bucket is None:
                bucket = by_depth[depth] = OrderedDict()
                if depth > self._top[weight]:
                    self._top[weight] = depth
            bucket[tenant] = next(self._stamp)
        else:
            del self._place[tenant]
        if old is not None:
            self._leave(tenant, *old)

    def _leave(self, tenant: str, weight: float, depth: int) -> None:
        by_depth = self._buckets[weight]
        bucket = by_depth[depth]
        del bucket[tenant]
        if bucket:
            return
        del by_depth[depth]
        if not by_depth:
            del self._buckets[weight], self._top[weight]
            return
        top = self._top[weight]
        while top not in by_depth:  # one step, unless a weight changed on reload
            top -= 1
        self._top[weight] = top

    def largest(self, *, excluding: str) -> tuple[float, str] | None:
        """(share after losing one, tenant) of the largest share held by another tenant."""
        best: tuple[float, int, str] | None = None
        for weight, by_depth in self._buckets.items():
            depth = self._top[weight]
            # The excluded tenant alone at the top of its weight: the others of that weight
            # hold less than it would, so none of them could make room for it anyway.
            found = next(((t, s) for t, s in by_depth[depth].items() if t != excluding), None)
            if found is None:
                continue
            share = (depth - 1) / weight
            if best is None or share > best[0] or (share == best[0] and found[1] < best[1]):
                best = (share, found[1], found[0])
        return (best[0], best[2]) if best is not None else None


class NoDisplacement:
    """Plain tail drop: a full tier refuses the newcomer, whoever fills it."""

    def backlog_changed(self, tier: str, tenant: str, backlog: TenantBacklog | None) -> None:
        pass

    def victim(self, tier: str, newcomer: QueuedRequest, newcomer_depth: int) -> str | None:
        return None
