"""Quotas in a real Redis (proxy.replicas.quotas): two books stand for two replicas, each with its
own connection, against one Redis, on a fake wall clock that crosses midnight and a month's end;
Redis down: the local ledger goes on from the counters as Redis last gave them, and what it
charged meanwhile reaches Redis once it answers again."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.api.errors import ProxyError
from proxy.bench.inproc import until
from proxy.bench.redis_server import RedisServer
from proxy.config.shared_state import SharedState
from proxy.replicas.client import SharedStateBusy, SharedStore
from proxy.replicas.quotas import SharedQuotaBook
from proxy.scheduling.quotas import QuotaAsk
from tests.helpers.clock import FakeClock
from tests.helpers.replicas import LIVE_REDIS
from tests.helpers.shared_store import warm

DAY = {"tokens_per_day": 1000.0}


# Next year's dates: Redis expires the counters by the real clock at the period's end (plus a
# grace), so a fixed date would expire at once once the real date passed it.
YEAR = datetime.now(UTC).year + 1


def at(month_day_time: str, years_on: int = 0) -> float:
    """``"12-01T12:00:00"`` of next year (and ``years_on`` more), UTC."""
    text = f"{YEAR + years_on}-{month_day_time}"
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def ask(tokens: float, limits: dict[str, float] | None = None, cost: float = 0.0) -> QuotaAsk:
    return QuotaAsk("acme", limits or DAY, tokens, cost)


@pytest.fixture
async def books(redis_server: RedisServer) -> AsyncIterator[Callable[..., Any]]:
    made: list[SharedQuotaBook] = []

    async def make(n: int, **cfg: Any) -> list[SharedQuotaBook]:
        for _ in range(n):
            store = SharedStore(
                SharedState(url=redis_server.url, **{**LIVE_REDIS, **cfg}), CollectorRegistry()
            )
            await warm(store)
            made.append(SharedQuotaBook(store))
        return made[-n:]

    yield make
    for book in made:
        await book.stop()
        await book.store.close()


async def settled(book: SharedQuotaBook) -> None:
    await until(lambda: not book._tasks, 5, "the correction to reach Redis")


async def test_a_quota_is_global_across_replicas_and_resets_at_midnight(
    books: Callable[..., Any],
) -> None:
    a, b = await books(2)
    wall = FakeClock(at("12-01T22:00:00"))
    first = await a.reserve(ask(600), wall())
    assert first.allowed and first.hold is not None and first.hold.shared
    refused = await b.reserve(ask(500), wall())  # the other replica sees the 600
    assert not refused.allowed and refused.which == "tokens_per_day"
    assert refused.used == 600 and refused.retry_after_s == pytest.approx(7200)
    a.settle(first.hold, 100.0, None)  # it used 100: 500 come back, for every replica
    await settled(a)
    assert (await b.reserve(ask(500), wall())).allowed
    assert not (await a.reserve(ask(401), wall())).allowed
    wall.advance(7200)  # 00:00 UTC: a new key, a new day
    assert (await b.reserve(ask(1000), wall())).allowed


async def test_keys_expire_a_day_after_their_period(
    books: Callable[..., Any], redis_server: RedisServer
) -> None:
    (a,) = await books(1)
    wall = FakeClock(at("12-31T23:00:00"))
    limits = {"tokens_per_day": 1000.0, "tokens_per_month": 5000.0, "budget_per_month": 9.0}
    assert (await a.reserve(ask(10, limits, cost=0.5), wall())).allowed
    redis = a.store.redis
    keys = sorted(k.decode() for k in await redis.keys("tierproxy:v2:quota:*:20*"))
    assert keys == [
        f"tierproxy:v2:quota:{{acme}}:budget_per_month:{YEAR}-12",
        f"tierproxy:v2:quota:{{acme}}:tokens_per_day:{YEAR}-12-31",
        f"tierproxy:v2:quota:{{acme}}:tokens_per_month:{YEAR}-12",
    ]
    for key in keys:  # each ends with the new year, 00:00 UTC, plus a day's grace
        expires_at = await redis.pexpiretime(key)
        assert expires_at == int((at("01-01T00:00:00", years_on=1) + 86400) * 1000)
    assert float(await redis.get(keys[0])) == pytest.approx(0.5)


async def test_a_month_boundary_settles_into_the_old_month(books: Callable[..., Any]) -> None:
    a, b = await books(2)
    wall = FakeClock(at("12-31T23:59:30"))
    month = {"tokens_per_month": 1000.0}
    late = await a.reserve(ask(900, month), wall())
    assert late.hold is not None
    wall.advance(60)  # it ends in January, having used 50: December gets the correction
    a.settle(late.hold, 50.0, None)
    await settled(a)
    redis = a.store.redis
    assert float(await redis.get(f"tierproxy:v2:quota:{{acme}}:tokens_per_month:{YEAR}-12")) == 50
    assert await redis.get(f"tierproxy:v2:quota:{{acme}}:tokens_per_month:{YEAR + 1}-01") is None
    assert (await b.reserve(ask(1000, month), wall())).allowed  # January is whole


async def test_redis_down_goes_on_from_the_last_counts_and_catches_up(
    books: Callable[..., Any], redis_server: RedisServer
) -> None:
    # 2 s calls: a killed Redis refuses at once, a live one on a busy machine is not timed out.
    (a,) = await books(1, call_timeout_s=2.0, probe_interval_s=0.05)
    wall = FakeClock(at("12-01T12:00:00"))
    first = await a.reserve(ask(700), wall())
    assert first.hold is not None
    redis_server.kill()
    # Decided locally, from the 700 Redis last said: not a fresh day's quota.
    refused = await a.reserve(ask(400), wall())
    assert not refused.allowed and refused.used == 700
    assert not a.store.up
    local = await a.reserve(ask(200), wall())
    assert local.allowed and local.hold is not None and not local.hold.shared
    a.settle(local.hold, 250.0, None)  # used 250 while Redis was away
    a.settle(first.hold, 600.0, None)  # the shared one ends meanwhile: 100 back, owed too
    redis_server.start()  # an empty Redis (no persistence): it learns what was used
    await until(lambda: a.store.up, 5, "the probe to find Redis again")
    await settled(a)
    # A Redis that lost its data learns the net of what this replica charged while it was
    # away: 200 reserved + 50 past it - 100 the shared request gave back.
    key = f"tierproxy:v2:quota:{{acme}}:tokens_per_day:{YEAR}-12-01"
    assert float(await a.store.redis.get(key)) == 150
    assert a.usage("acme", DAY, wall())["tokens_per_day"]["used"] == 850


async def test_an_outage_that_kept_redis_data_ends_with_the_days_real_use(
    books: Callable[..., Any],
) -> None:
    a, b = await books(2, probe_interval_s=0.05)
    wall = FakeClock(at("12-01T12:00:00"))
    first = await a.reserve(ask(700), wall())
    assert first.hold is not None
    a.store.mark_down(ConnectionError("cut off"))  # this replica alone loses Redis
    local = await a.reserve(ask(200), wall())
    assert local.hold is not None and not local.hold.shared
    a.settle(local.hold, 250.0, None)
    a.settle(first.hold, 600.0, None)
    await until(lambda: a.store.up, 5, "the probe to find Redis again")
    await settled(a)
    # 600 + 250: every replica sees the day's real use again.
    refused = await b.reserve(ask(151), wall())
    assert not refused.allowed and refused.used == 850


async def test_refuse_answers_503_while_redis_is_down(
    books: Callable[..., Any], redis_server: RedisServer
) -> None:
    (a,) = await books(1, on_failure="refuse", call_timeout_s=2.0, probe_interval_s=0.05)
    redis_server.kill()
    with pytest.raises(ProxyError) as refused:
        await a.reserve(ask(1), FakeClock(at("12-01T12:00:00"))())
    assert refused.value.status == 503 and refused.value.code == "shared_state_unavailable"
    # The refused call's undo (it may have reached Redis) lands once Redis is back: nothing
    # stays owed (before, the stop waited out its grace for it, 8 call timeouts).
    redis_server.start()
    await until(lambda: a.store.up, 5, "the probe to find Redis again")
    await until(lambda: not a._owed_now() and not a._tasks, 5, "the undo to reach Redis")


async def test_a_busy_pool_decides_locally_and_redis_learns_it_later(
    books: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    (a,) = await books(1)
    wall = FakeClock(at("12-01T12:00:00"))

    async def busy(*_: Any) -> Any:
        raise SharedStateBusy("no connection free")

    with monkeypatch.context() as patch:
        patch.setattr(a.store, "run", busy)
        local = await a.reserve(ask(300), wall())
    assert local.hold is not None and not local.hold.shared and a.store.up  # Redis not down
    a.settle(local.hold, 100.0, None)
    # Redis never went down, so nothing calls on_up: the next call that reaches it catches up.
    assert (await a.reserve(ask(50), wall())).allowed
    await settled(a)
    key = f"tierproxy:v2:quota:{{acme}}:tokens_per_day:{YEAR}-12-01"
    assert float(await a.store.redis.get(key)) == 150
