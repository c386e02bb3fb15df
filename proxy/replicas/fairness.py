"""Global fairness: the tenants' virtual token counters (``proxy.policies.tenants``) merged
across replicas every ``sync_interval_s``. Each replica still picks from its own backlog, by
counters that include every replica's service: a tenant whose traffic lands on two replicas
gets one share, not two. Staleness: another replica's charge is seen here at most two sync
intervals (plus two round trips) after it was made. While Redis is down each replica keeps its
own counters and merges what it charged meanwhile once Redis is back (nothing is lost)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from proxy.policies.tenants import TenantFairness, VirtualTokenCounter
from proxy.replicas.client import SharedStateDown, SharedStore
from proxy.replicas.scripts import VTC_MERGE
from proxy.tasks import OwnedTask


class FairnessSync:
    def __init__(self, store: SharedStore, fairness: Callable[[], TenantFairness]) -> None:
        self.store = store
        self.fairness = fairness  # the queue's current policy (a reload may replace it)
        self.key = store.key("vtc")
        self._task = OwnedTask("tierproxy-shared-fairness")

    def start(self) -> None:
        self._task.start(self._run)

    async def stop(self) -> None:
        await self._task.stop()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.store.cfg.sync_interval_s)
            await self.merge()

    async def merge(self) -> bool:
        """One exchange with Redis; False when the policy shares nothing or Redis is down."""
        vtc = self.fairness()
        if not isinstance(vtc, VirtualTokenCounter):
            return False  # edf keeps no counters
        if vtc.unsynced is None:
            vtc.unsynced = {}
        if not self.store.up:
            return False
        sent, vtc.unsynced = vtc.unsynced, {}
        asked = [t for t in vtc.backlogged() if t not in sent]
        args: list[object] = [len(sent)]
        for tenant, delta in sent.items():
            args += [tenant, delta, vtc.counter(tenant)]
        try:
            reply = await self.store.run(VTC_MERGE, [self.key], [*args, *asked])
        except SharedStateDown:
            for tenant, delta in sent.items():  # merged next time instead
                vtc.unsynced[tenant] = vtc.unsynced.get(tenant, 0.0) + delta
            return False
        merged: dict[str, float] = {}
        for i in range(0, len(reply), 2):
            tenant = _text(reply[i])
            # Charges made here while the merge was on its way stay on top of it.
            merged[tenant] = float(reply[i + 1]) + vtc.unsynced.get(tenant, 0.0)
        vtc.absorb(merged)
        return True


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
