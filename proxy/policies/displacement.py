"""What a full tier does with a newcomer: name a tenant whose newest request makes room (the
queue displaces it; its client gets the 429), or None to refuse the newcomer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from proxy.policies.backlog import BacklogObserver, KeyedHeap, TenantBacklog

if TYPE_CHECKING:
    from proxy.admission import QueuedRequest


class Displacement(BacklogObserver, Protocol):
    def victim(self, tier: str, newcomer: QueuedRequest, newcomer_depth: int) -> str | None:
        """The tenant to lose its newest request so that ``newcomer`` gets in; ``newcomer_depth``:
        what the newcomer's tenant already has queued in the tier."""


class LargestShare:
    """The tenant holding the largest weighted share of the tier (queued requests over tenant
    weight; ties: the one backlogged longest), if that share, less the request it loses, is
    still at least what the newcomer's tenant would hold with one more. Compared after losing
    one, so that a swap never just reverses the imbalance (ping-pong). Longest-queue drop: a
    flooding tenant cannot lock the others out of their tier."""

    def __init__(self) -> None:
        self._by_tier: dict[str, KeyedHeap] = {}  # backlogged tenants by (-share, since)

    def backlog_changed(self, tier: str, tenant: str, backlog: TenantBacklog | None) -> None:
        heap = self._by_tier.setdefault(tier, KeyedHeap())
        if backlog is None:
            heap.discard(tenant)
        else:
            heap.set(tenant, (-(backlog.depth - 1) / backlog.weight, backlog.since))

    def victim(self, tier: str, newcomer: QueuedRequest, newcomer_depth: int) -> str | None:
        heap = self._by_tier.get(tier)
        found = heap.first(lambda t: t != newcomer.tenant) if heap is not None else None
        if found is None:
            return None
        (neg_share, _), tenant = found
        return tenant if -neg_share >= (newcomer_depth + 1) / newcomer.tenant_weight else None


class NoDisplacement:
    """Plain tail drop: a full tier refuses the newcomer, whoever fills it."""

    def backlog_changed(self, tier: str, tenant: str, backlog: TenantBacklog | None) -> None:
        pass

    def victim(self, tier: str, newcomer: QueuedRequest, newcomer_depth: int) -> str | None:
        return None
