"""Reconciliation of the shared quotas in a real Redis, on an injected wall clock: a write whose
answer is lost (it ran, or it never arrived) is sent again by its id and counts once; a
reservation whose answer is lost is undone; an undo that overtakes its reservation makes it
charge nothing. And one tenant's unreadable counter is that tenant's problem alone."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.api.errors import ProxyError
from proxy.bench.inproc import until
from proxy.bench.redis_server import RedisServer
from proxy.config.shared_state import SharedState
from proxy.replicas.client import SharedStateDown, SharedStore
from proxy.replicas.quotas import RECORD_TTL_S, SharedQuotaBook
from proxy.scheduling.quotas import QuotaAsk
from tests.helpers.clock import FakeClock
from tests.helpers.replicas import LIVE_REDIS
from tests.helpers.shared_store import warm

DAY = {"tokens_per_day": 1000.0}
# Next year's: Redis expires the counters by the real clock at the period's end (plus a grace),
# so a fixed date would expire at once once the real date passed it.
YEAR = datetime.now(UTC).year + 1
NOON = datetime(YEAR, 12, 1, 12, tzinfo=UTC).timestamp()
KEY = "tierproxy:v2:quota:{%s}:tokens_per_day:" + f"{YEAR}-12-01"


def ask(tokens: float, tenant: str = "acme") -> QuotaAsk:
    return QuotaAsk(tenant, DAY, tokens, 0.0)


@pytest.fixture
async def book(redis_server: RedisServer) -> AsyncIterator[SharedQuotaBook]:
    store = SharedStore(
        SharedState(url=redis_server.url, on_failure="refuse", **LIVE_REDIS), CollectorRegistry()
    )
    await warm(store)
    made = SharedQuotaBook(store, clock=FakeClock(NOON))
    yield made
    await made.stop()
    await store.close()


def lose_answers(book: SharedQuotaBook, monkeypatch: pytest.MonkeyPatch, ran: bool) -> list[Any]:
    """The next calls time out: after running in Redis (``ran``), or before reaching it (their
    arguments kept, to deliver late)."""
    real, late = book.store.run, []

    async def lost(script: Any, keys: Any, args: Any) -> Any:
        if ran:
            await real(script, keys, args)
        else:
            late.append((script, keys, args))
        raise SharedStateDown("timed out")

    monkeypatch.setattr(book.store, "run", lost)
    return late


async def counter(book: SharedQuotaBook, tenant: str = "acme") -> float:
    return float(await book.store.redis.get(KEY % tenant) or 0)


async def settled(book: SharedQuotaBook) -> None:
    await until(lambda: not book._tasks, 5, "the writes to reach Redis")


async def test_a_reservation_that_ran_but_whose_answer_was_lost_is_undone(
    book: SharedQuotaBook, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as patch:
        lose_answers(book, patch, ran=True)
        with pytest.raises(ProxyError):  # on_failure: refuse
            await book.reserve(ask(600), NOON)
    assert await counter(book) == 600  # charged in Redis for a refused request
    served = await book.reserve(ask(300), NOON)  # Redis answers: the lost one is undone
    assert served.allowed and served.hold is not None
    await settled(book)
    assert await counter(book) == 300
    book.settle(served.hold, 120, None)
    await settled(book)
    assert await counter(book) == 120


async def test_an_undo_that_overtakes_its_reservation_makes_it_charge_nothing(
    book: SharedQuotaBook, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as patch:
        late = lose_answers(book, patch, ran=False)
        with pytest.raises(ProxyError):
            await book.reserve(ask(600), NOON)
    book._catch_up()  # the undo first (Redis answers again)
    await settled(book)
    script, keys, args = late[0]
    answer = await book.store.run(script, keys, args)  # then the stalled reservation arrives
    assert int(answer[0]) == -2
    assert await counter(book) == 0


async def test_a_settle_sent_twice_counts_once(
    book: SharedQuotaBook, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = await book.reserve(ask(600), NOON)
    assert held.hold is not None
    with monkeypatch.context() as patch:
        lose_answers(book, patch, ran=True)
        book.settle(held.hold, 100, None)  # applied, but the answer is lost
        await until(lambda: bool(book._unanswered), 5, "the settle's answer lost")
    assert await counter(book) == 100
    book._catch_up()  # sent again, same id (as the retry after a probe interval would)
    await settled(book)
    assert await counter(book) == 100
    assert not book._unanswered


async def test_a_settle_lost_while_redis_still_counts_as_up_lands_with_no_later_request(
    book: SharedQuotaBook, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reconciliation under load (stop 57): the run's last settles timed out in a stall too
    short to mark Redis down, and waited for a next reservation that never came (a counter
    345 tokens over the usage log). They are sent again after a probe interval."""
    held = await book.reserve(ask(600), NOON)
    assert held.hold is not None
    with monkeypatch.context() as patch:
        lose_answers(book, patch, ran=False)
        book.settle(held.hold, 100, None)  # times out before reaching Redis
        await until(lambda: bool(book._unanswered), 5, "the settle's call timed out")
    assert book.store.up and await counter(book) == 600
    await until(lambda: not book._unanswered, 10, "sent again, no reservation since")
    await settled(book)
    assert await counter(book) == 100


async def test_a_correction_owed_after_redis_came_back_lands_with_no_later_request(
    redis_server: RedisServer,
) -> None:
    """A request reserved while Redis was away (decided locally, charged there once it
    answers) ends after it came back: the correction of its reservation to its usage is owed,
    and sent after a probe interval. It waited for the replica's next reservation, and at a
    quiet replica's last request never landed: the tenant over-counted on every replica."""
    config = SharedState(url=redis_server.url, on_failure="local", **LIVE_REDIS)
    store = SharedStore(config, CollectorRegistry())
    await warm(store)
    book = SharedQuotaBook(store, clock=FakeClock(NOON))
    store.mark_down(SharedStateDown("a test's outage"))
    held = await book.reserve(ask(600), NOON)  # decided locally, owed to Redis
    assert held.hold is not None and not held.hold.shared
    await until(lambda: store.up, 10, "Redis marked up again by its probe")
    await until(lambda: not book._pending and not book._tasks, 5, "the owed charge sent")
    assert await counter(book) == 600
    book.settle(held.hold, 100, None)  # Redis is up: owed, no reservation after it
    await until(lambda: not book._pending and not book._tasks, 10, "the correction sent")
    assert await counter(book) == 100
    await book.stop()
    await store.close()


async def test_a_replica_stopped_with_a_retry_sleeping_sends_its_writes_first(
    book: SharedQuotaBook, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Red team F8 (stop 58): a replica stopped right after a stall. Its lost settle waited in
    a sleeping retry; stopping awaited the sleep but not the writes it then started, and the
    store closed under them (counters 314 and 424 over the bill)."""
    held = await book.reserve(ask(600), NOON)
    assert held.hold is not None
    with monkeypatch.context() as patch:
        lose_answers(book, patch, ran=False)
        book.settle(held.hold, 100, None)  # times out: sent again after a probe interval
        await until(lambda: bool(book._unanswered), 5, "the settle's call timed out")
    assert book._retry_due
    await book.stop()
    await book.store.close()  # as the runtime does next
    assert not book._unanswered and not book._pending
    assert float(await book.store.redis.get(KEY % "acme") or 0) == 100


async def test_records_expire_by_the_clock(book: SharedQuotaBook) -> None:
    assert isinstance(book.clock, FakeClock)
    for _ in range(3):
        assert (await book.reserve(ask(10), NOON)).allowed
    due = "tierproxy:v2:quota:{acme}:ops:due"
    assert await book.store.redis.zcard(due) == 3
    book.clock.advance(RECORD_TTL_S + 1)  # the next write prunes the old records
    assert (await book.reserve(ask(10), NOON)).allowed
    assert await book.store.redis.zcard(due) == 1


@pytest.mark.parametrize("value", ["hash", "text", "nan"])
async def test_a_bad_counter_refuses_its_tenant_alone(book: SharedQuotaBook, value: str) -> None:
    redis = book.store.redis
    if value == "hash":
        await redis.hset(KEY % "acme", "used", "5")
    else:
        await redis.set(KEY % "acme", "abc" if value == "text" else "nan")
    with pytest.raises(ProxyError) as refused:
        await book.reserve(ask(10), NOON)
    assert refused.value.code == "shared_state_unavailable"
    assert book.store.up  # Redis is fine: every other tenant goes on
    assert (await book.reserve(ask(10, "beta"), NOON)).allowed
    assert book.store.bad_keys.labels("quota")._value.get() == 1
    await redis.delete(KEY % "acme")  # the operator's fix: the tenant is served again
    assert (await book.reserve(ask(10), NOON)).allowed


@pytest.mark.parametrize("raw", ["5\n", " 5", "5 "])
async def test_a_counter_with_space_around_its_number_charges_no_other_counter(
    book: SharedQuotaBook, monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    """Red team F1 (stop 58): Lua's tonumber reads "5\n" (what `redis-cli -x SET` writes),
    INCRBYFLOAT refuses it. The script charged the tenant's first counter, failed at the
    second, recorded nothing; sent again every probe interval, it charged again each time
    (6,169 counted for 325 billed, then 8.5 million). Now such a counter is a bad key: nothing
    charged, and a correction owed for it is not sent again and again."""
    both = {"tokens_per_day": 1000.0, "budget_per_day": 1000.0}
    budget = KEY.replace("tokens_per_day", "budget_per_day") % "acme"
    held = await book.reserve(QuotaAsk("acme", both, 600, 6.0), NOON)
    assert held.hold is not None
    await book.store.redis.set(budget, raw)  # an operator's edit while the request runs
    with pytest.raises(ProxyError) as refused:
        await book.reserve(QuotaAsk("acme", both, 10, 0.1), NOON)
    assert refused.value.code == "shared_state_unavailable"
    assert await counter(book) == 600  # the refused reservation charged no counter
    book.settle(held.hold, 100, 1.0)  # its correction is not written while the key is bad
    await settled(book)
    for _ in range(3):  # nor on later catch-ups: it stays owed, written once the key is fixed
        book._catch_up()
        await settled(book)
    assert await counter(book) == 600
    await book.store.redis.set(budget, "6")  # the operator's fix
    assert (await book.reserve(QuotaAsk("acme", both, 10, 0.1), NOON)).allowed
    await settled(book)
    assert await counter(book) == 110  # 600 reserved, -500 owed and written, +10


async def test_a_ledger_of_the_wrong_type_is_reset(book: SharedQuotaBook) -> None:
    await book.store.redis.set("tierproxy:v2:quota:{acme}:ops", "old format")
    held = await book.reserve(ask(600), NOON)
    assert held.allowed and held.hold is not None
    assert book.store.bad_keys.labels("ledger")._value.get() == 1
    book.settle(held.hold, 100, None)
    await settled(book)
    assert await counter(book) == 100


async def test_local_charges_reach_a_bad_counter_once_it_is_fixed(
    redis_server: RedisServer,
) -> None:
    store = SharedStore(
        SharedState(url=redis_server.url, **LIVE_REDIS), CollectorRegistry()
    )  # local
    book = SharedQuotaBook(store, clock=FakeClock(NOON))
    try:
        await store.redis.hset(KEY % "acme", "used", "5")
        local = await book.reserve(ask(200), NOON)  # decided by this replica's ledger
        assert local.hold is not None and not local.hold.shared
        book.settle(local.hold, 50, None)
        assert (await book.reserve(ask(1, "beta"), NOON)).allowed  # pushes acme's: refused
        await settled(book)
        await store.redis.delete(KEY % "acme")
        assert (await book.reserve(ask(1, "beta"), NOON)).allowed
        await settled(book)
        assert await counter(book) == 50
    finally:
        await book.stop()
        await store.close()
