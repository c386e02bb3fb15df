"""Global fairness through Redis: two replicas' virtual token counters merged by
``FairnessSync`` on a real redis-server. The heavy tenant sends to both replicas, the light one
to replica A only; A serves one of them per step, B serves heavy. Merged after every step (the
sync interval), A sees heavy's service on B and gives its slots to light: one share each."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from proxy.bench.redis_server import RedisServer
from proxy.config.shared_state import SharedState
from proxy.policies.backlog import TenantBacklog
from proxy.policies.tenants import VirtualTokenCounter
from proxy.policies.types import QueuedRequest
from proxy.replicas.client import SharedStore
from proxy.replicas.fairness import FairnessSync
from tests.helpers.replicas import LIVE_REDIS

COST = 100.0  # weighted tokens of every request


def backlog(tenant: str) -> TenantBacklog:
    req = QueuedRequest(
        tier="normal", tenant=tenant, prompt_tokens=50, expected_output=25, arrival_s=0.0
    )
    return TenantBacklog(depth=1, weight=1.0, oldest=req, since=0)


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


@pytest.fixture
async def stores(redis_server: RedisServer) -> AsyncIterator[list[SharedStore]]:
    made = [
        SharedStore(SharedState(url=redis_server.url, **LIVE_REDIS), CollectorRegistry())
        for _ in range(2)
    ]
    yield made
    for store in made:
        await store.close()


async def run(stores: list[SharedStore], *, shared: bool, steps: int = 200) -> Counter[str]:
    a, b = VirtualTokenCounter(), VirtualTokenCounter()
    a.backlog_changed("normal", "heavy", backlog("heavy"))
    a.backlog_changed("normal", "light", backlog("light"))
    b.backlog_changed("normal", "heavy", backlog("heavy"))
    syncs = [FairnessSync(stores[0], lambda: a), FairnessSync(stores[1], lambda: b)]
    served: Counter[str] = Counter()
    for _ in range(steps):
        for vtc in (a, b):
            tenant = vtc.pick("normal")
            assert tenant is not None
            vtc.charge(tenant, COST)
            served[tenant] += 1
        if shared:
            for sync in syncs:
                assert await sync.merge()
    return served


async def test_two_replicas_give_one_share_per_tenant(stores: list[SharedStore]) -> None:
    served = await run(stores, shared=True)
    assert jain([served["heavy"], served["light"]]) >= 0.95, served


async def test_without_merging_the_tenant_on_two_replicas_gets_two_shares(
    stores: list[SharedStore],
) -> None:
    served = await run(stores, shared=False)
    assert served["heavy"] >= 2.9 * served["light"]  # 3:1
    assert jain([served["heavy"], served["light"]]) < 0.85


async def test_charges_made_while_redis_is_down_are_merged_later(
    stores: list[SharedStore], redis_server: RedisServer
) -> None:
    vtc = VirtualTokenCounter()
    sync = FairnessSync(stores[0], lambda: vtc)
    await sync.merge()  # starts recording
    vtc.charge("heavy", COST)
    redis_server.kill()
    assert not await sync.merge()
    assert not stores[0].up
    redis_server.start()
    for store in stores:  # as each replica's probe would once Redis answers again: a pooled
        store.up = True  # connection from before the restart is dead (the other replica's
        await store.redis.connection_pool.disconnect()  # failed its first merge, now and then)
    vtc.backlog_changed("normal", "heavy", backlog("heavy"))
    assert await sync.merge()
    other = VirtualTokenCounter()
    other.backlog_changed("normal", "heavy", backlog("heavy"))
    assert await FairnessSync(stores[1], lambda: other).merge()
    assert other.counter("heavy") == COST
