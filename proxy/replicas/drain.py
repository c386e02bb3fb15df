"""Admin drains that every replica applies: one proxy (or one worker of ``serve --workers N``)
takes ``POST /admin/backends/drain``, but every replica sends work to the backend.

The drained backends are a Redis hash (url -> 1), written by the admin endpoint and read by
every replica once a ``SYNC_S``; the admin endpoint answers after ``settle_s`` (two sync
periods), so that by its answer every live replica has applied the drain. A replica that starts
later (or comes back after Redis was down) finds it there. A drain this replica
applied alone (Redis down at the time) is left as it is: the sync undoes only what it did.
"""

from __future__ import annotations

import asyncio
import contextlib

from proxy.backends.pool import BackendPool
from proxy.replicas.client import SharedStateDown, SharedStore
from proxy.tasks import OwnedTask

# Drains are rare operator actions: a poll (4 cheap HKEYS a second per replica) needs no
# subscriber connection and converges after a missed message or a restart by itself.
SYNC_S = 0.25


class SharedDrain:
    def __init__(self, store: SharedStore, pool: BackendPool, *, sync_s: float = SYNC_S) -> None:
        self.store = store
        self.pool = pool
        self.sync_s = sync_s
        self.key = store.key("drained")
        self._from_redis: set[str] = set()  # urls this replica drains because Redis says so
        self._task = OwnedTask("tierproxy-shared-drain")

    def start(self) -> None:
        self._task.start(self._run)

    async def stop(self) -> None:
        await self._task.stop()

    @property
    def settle_s(self) -> float:
        """How long after ``publish`` every live replica has synced at least once."""
        return 2 * self.sync_s

    async def publish(self, url: str, draining: bool) -> None:
        """Record an admin drain (or its end) for every replica; ``SharedStateDown`` when
        Redis cannot take it (the caller's replica has applied it alone)."""
        if draining:
            await self.store.call(lambda redis: redis.hset(self.key, url, "1"))
        else:
            await self.store.call(lambda redis: redis.hdel(self.key, url))
        # Ours by Redis now: a later sync that finds it gone takes it back here too.
        (self._from_redis.add if draining else self._from_redis.discard)(url)

    async def sync(self) -> bool:
        """Apply the drains in Redis to this replica's pool; True when one changed."""
        raw = await self.store.call(lambda redis: redis.hkeys(self.key))
        drained = {k.decode() if isinstance(k, bytes) else str(k) for k in raw}
        changed = False
        for backend in self.pool.all():
            url = backend.cfg.url
            if url in drained and not backend.draining:
                changed |= self.pool.drain(url, True) is not None
                self._from_redis.add(url)
            elif url not in drained and url in self._from_redis:
                self._from_redis.discard(url)
                if backend.draining:
                    changed |= self.pool.drain(url, False) is not None
        return changed

    async def _run(self) -> None:
        while True:
            if self.store.up:
                # Down: the store marks itself so and probes; the next pass tries again.
                with contextlib.suppress(SharedStateDown):
                    await self.sync()
            await asyncio.sleep(self.sync_s)
