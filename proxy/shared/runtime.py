"""Everything ``shared_state:`` adds to one proxy process, started and stopped with the app."""

from __future__ import annotations

from collections.abc import Callable

from redis.exceptions import RedisError

from proxy.metrics import ProxyMetrics
from proxy.policies.tenants import TenantFairness
from proxy.shared.client import SharedStore
from proxy.shared.config import SharedState
from proxy.shared.fairness import FairnessSync
from proxy.shared.limits import SharedLimitRegistry


class SharedRuntime:
    def __init__(
        self, cfg: SharedState, metrics: ProxyMetrics, fairness: Callable[[], TenantFairness]
    ) -> None:
        self.store = SharedStore(cfg, metrics.registry)
        self.limits = SharedLimitRegistry(self.store)
        self.fairness = FairnessSync(self.store, fairness)

    async def start(self) -> None:
        try:
            await self.store.warm()
        except (RedisError, OSError, TimeoutError) as exc:
            self.store.mark_down(exc)  # serve anyway; on_failure decides until Redis answers
        self.limits.start()
        self.fairness.start()

    async def stop(self) -> None:
        await self.fairness.stop()
        await self.limits.stop()
        await self.store.close()
