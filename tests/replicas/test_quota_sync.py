"""A replica keeps a copy of every configured tenant's quota counters (``QuotaSync``), so that
under ``on_failure: local`` a tenant it never served is decided on what it used, not from zero
(red team, stop 58: a replica the tenant had not reached admitted a fresh day's quota during a
6 s stall, 5,610 tokens counted on a limit of 3,000). Real Redis."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from proxy.bench.redis_server import RedisServer
from proxy.config.shared_state import SharedState
from proxy.replicas.client import SharedStateDown, SharedStore
from proxy.replicas.quota_sync import QuotaSync
from proxy.replicas.quotas import SharedQuotaBook
from proxy.scheduling.quotas import QuotaAsk, period
from tests.helpers.replicas import LIVE_REDIS
from tests.helpers.shared_store import warm

DAY = {"tokens_per_day": 3000.0}


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[list[SharedQuotaBook]]:
    books = []
    for _ in range(2):
        store = SharedStore(
            SharedState(url=redis_server.url, on_failure="local", **LIVE_REDIS),
            CollectorRegistry(),
        )
        await warm(store)
        books.append(SharedQuotaBook(store))
    yield books
    for book in books:
        await book.stop()
        await book.store.close()


def copy_of(book: SharedQuotaBook) -> QuotaSync:
    sync = QuotaSync(book.store, book.local, book.key, book.owed)
    sync.watch({"acme": ["tokens_per_day"], "idle": []})
    return sync


async def test_a_tenant_another_replica_served_is_decided_on_its_counter_when_redis_goes(
    replicas: list[SharedQuotaBook],
) -> None:
    a, b = replicas
    wall = time.time()
    assert (await a.reserve(QuotaAsk("acme", DAY, 2800, 0.0), wall)).allowed  # through A
    await copy_of(b).sync()  # B never served acme: its copy comes from Redis
    b.store.mark_down(SharedStateDown("a test's outage"))
    refused = await b.reserve(QuotaAsk("acme", DAY, 300, 0.0), wall)
    assert not refused.allowed  # 2,800 + 300 is past 3,000: not a fresh day
    assert (await b.reserve(QuotaAsk("acme", DAY, 200, 0.0), wall)).allowed


async def test_the_copy_keeps_what_this_replica_charged_that_redis_has_not_taken(
    replicas: list[SharedQuotaBook],
) -> None:
    a, b = replicas
    wall = time.time()
    assert (await a.reserve(QuotaAsk("acme", DAY, 1000, 0.0), wall)).allowed
    day = period("day", wall)[0]
    b._pending[("acme", "tokens_per_day", day)] = 1500.0  # charged while Redis was away
    await copy_of(b).sync()
    assert b.local.get("acme", "tokens_per_day", day) == 2500.0
    b.store.mark_down(SharedStateDown("a test's outage"))
    assert not (await b.reserve(QuotaAsk("acme", DAY, 600, 0.0), wall)).allowed


async def test_a_large_tenants_file_is_read_in_slices_and_whole(
    replicas: list[SharedQuotaBook],
) -> None:
    a, b = replicas
    wall = time.time()
    tenants = [f"t{i:03}" for i in range(600)]  # past two slices of KEYS_A_CALL
    assert (await a.reserve(QuotaAsk(tenants[-1], DAY, 700, 0.0), wall)).allowed
    sync = QuotaSync(b.store, b.local, b.key, b.owed)
    sync.watch({t: ["tokens_per_day"] for t in tenants})
    await sync.sync()
    assert b.local.get(tenants[-1], "tokens_per_day", period("day", wall)[0]) == 700.0
    assert b.store.up
