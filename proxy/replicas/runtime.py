"""Everything ``shared_state:`` adds to one proxy process, started and stopped with the app."""

from __future__ import annotations

from collections.abc import Callable

from redis.exceptions import RedisError

from proxy.backends.pool import BackendPool
from proxy.config.shared_state import SharedState
from proxy.replicas.adapter_claims import SharedAdapterSlots
from proxy.replicas.client import SharedStore
from proxy.replicas.drain import SharedDrain
from proxy.replicas.fairness import FairnessSync
from proxy.replicas.limits import SharedLimitRegistry
from proxy.replicas.quota_sync import QuotaSync
from proxy.replicas.quotas import SharedQuotaBook
from proxy.replicas.room import SharedBackendRoom
from proxy.scheduling.queue import AdmissionQueue
from proxy.telemetry.metrics import ProxyMetrics


class SharedRuntime:
    def __init__(
        self,
        cfg: SharedState,
        metrics: ProxyMetrics,
        queue: AdmissionQueue,
        pool: BackendPool,
        kick: Callable[[], None],
    ) -> None:
        self.queue = queue
        self.store = SharedStore(cfg, metrics.registry)
        self.limits = SharedLimitRegistry(self.store)
        self.quotas = SharedQuotaBook(self.store)
        # For on_failure: local, every tenant's counters as Redis last had them (docs/quotas.md).
        quotas = self.quotas
        self.quota_copy = QuotaSync(self.store, quotas.local, quotas.key, quotas.owed)
        self.fairness = FairnessSync(self.store, lambda: queue.fairness)
        self.room = SharedBackendRoom(
            self.store,
            pool,
            replica=self.limits.replica,
            waiting=lambda: len(queue),
            best_tier_waiting=self.best_tier_waiting,
            kick=kick,
        )
        self.adapters = SharedAdapterSlots(self.store, pool, replica=self.limits.replica, kick=kick)
        self.drain = SharedDrain(self.store, pool)

    def best_tier_waiting(self) -> bool:
        """A request of the best configured tier waits here (it may take the reserve)."""
        tiers = self.queue.tiers()
        if not tiers:
            return False
        best = min(self.queue.limits(t).priority for t in tiers)
        return any(self.queue.depth(t) for t in tiers if self.queue.limits(t).priority == best)

    async def start(self) -> None:
        try:
            await self.store.warm()
        except (RedisError, OSError, TimeoutError) as exc:
            self.store.mark_down(exc)  # serve anyway; on_failure decides until Redis answers
        self.limits.start()
        self.fairness.start()
        self.room.start()
        self.adapters.start()
        self.drain.start()
        self.quota_copy.start()

    async def stop(self) -> None:
        await self.drain.stop()
        await self.adapters.stop()
        await self.room.stop()
        await self.fairness.stop()
        await self.limits.stop()
        await self.quota_copy.stop()
        await self.quotas.stop()
        await self.store.close()
