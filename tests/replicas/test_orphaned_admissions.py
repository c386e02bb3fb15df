"""A client that leaves while its admission is in Redis (a slow Redis, a busy server) must not
leave what the admission took: the concurrency slot, the minute's tokens, the day's quota. The
script runs on in Redis once sent; the store hands its answer to an undo (``run_or_undo``).
Real Redis behind a link that delays its answers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from proxy.bench.inproc import until
from proxy.bench.redis_server import RedisServer
from proxy.config.shared_state import SharedState
from proxy.config.tenants import Tenant
from proxy.replicas.client import SharedStore
from proxy.replicas.limits import SharedLimitRegistry
from proxy.replicas.quota_scripts import RESERVE
from proxy.replicas.quotas import SharedQuotaBook
from proxy.replicas.scripts import ADMIT
from proxy.scheduling.quotas import QuotaAsk
from tests.helpers.replicas import day_counter
from tests.helpers.shared_store import warm
from tests.helpers.timing import polls_until

REPLY_DELAY_S = 0.4  # Redis's answers reach the proxy this late (under the call timeout)


class SlowReplies:
    """A TCP link to Redis whose answers arrive ``REPLY_DELAY_S`` late: a client can leave
    after Redis ran the script and before the proxy read its answer (the window a far or
    loaded Redis opens). A command Redis never read is never run: no window there."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.delay_s = REPLY_DELAY_S  # read at each answer: a test may change it
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> SlowReplies:
        self.server = await asyncio.start_server(self._link, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _link(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        redis_r, redis_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        for pipe in (self._pipe(client_r, redis_w, 0.0), self._pipe(redis_r, client_w, 1.0)):
            task = asyncio.create_task(pipe)
            self.tasks.add(task)

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, late: float
    ) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(65536):
                await asyncio.sleep(self.delay_s * late)
                dst.write(data)
                await dst.drain()
        dst.close()


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[SharedStore]:
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    async with SlowReplies(port) as link:
        # A store on the slow link; warm() first, at once (its pings cross the link too).
        shared = SharedStore(
            SharedState(url=link.url, call_timeout_s=5.0, max_connections=2), CollectorRegistry()
        )
        await warm(shared)
        # Loaded before: a first call's NOSCRIPT round trip would be the one the client leaves.
        await asyncio.gather(*(shared.redis.script_load(x.source) for x in (ADMIT, RESERVE)))
        yield shared
        await shared.close()


async def leave_midway(call: asyncio.Task[object]) -> None:
    await asyncio.sleep(REPLY_DELAY_S / 2)  # run by Redis, its answer still on the way
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_a_client_leaving_mid_admission_gives_back_its_slot_and_tokens(
    store: SharedStore,
) -> None:
    acme = Tenant(
        name="acme",
        tier="normal",
        keys=[{"sha256": "0" * 64}],
        max_concurrent=1,
        tokens_per_minute=600,
    )
    limits = SharedLimitRegistry(store)
    limits.configure([acme], time.monotonic())
    await leave_midway(asyncio.create_task(limits.admit("acme", 500, 0.0)))
    await until(lambda: not store._orphans and not limits._settling, 5, "the give-back")
    # Before: the orphan held the only slot (until its lease ran out) and 500 of 600 tokens.
    verdict = await limits.admit("acme", 600, 0.0)
    assert verdict.allowed, verdict
    await limits.stop()


async def test_a_client_leaving_mid_reservation_gives_back_its_quota(
    store: SharedStore,
) -> None:
    book = SharedQuotaBook(store)
    day = {"tokens_per_day": 1000.0}
    wall = time.time()
    await leave_midway(asyncio.create_task(book.reserve(QuotaAsk("acme", day, 800, 0.0), wall)))
    await until(lambda: not store._orphans and not book._tasks, 5, "the give-back")
    # Before: the day's quota kept the 800 of a request that never ran.
    verdict = await book.reserve(QuotaAsk("acme", day, 1000, 0.0), wall)
    assert verdict.allowed, verdict
    await book.stop()


async def test_a_client_leaving_before_a_reservation_that_then_times_out_is_not_charged(
    redis_server: RedisServer,
) -> None:
    """The client leaves mid-reservation, and the call then times out (Redis slower than the
    call timeout), though Redis ran the script: the reservation is taken back by its id when
    Redis answers again. Before, the orphan's failure was dropped and the day's counter kept
    the whole reservation of a request that never ran (the reconciliation through a Redis
    stall: counters 214 and 345 tokens over the usage log)."""
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    direct = Redis.from_url(redis_server.url, socket_timeout=5)
    async with SlowReplies(port) as link:
        config = SharedState(
            url=link.url, call_timeout_s=REPLY_DELAY_S / 2, probe_interval_s=0.1, max_connections=2
        )
        store = SharedStore(config, CollectorRegistry())
        link.delay_s = 0.0
        await warm(store)
        await store.redis.script_load(RESERVE.source)
        book = SharedQuotaBook(store)
        day = {"tokens_per_day": 1000.0}
        link.delay_s = REPLY_DELAY_S  # the answer comes past the call timeout
        reserving = asyncio.create_task(book.reserve(QuotaAsk("acme", day, 800, 0.0), time.time()))
        await asyncio.sleep(REPLY_DELAY_S / 4)  # sent; the client leaves before the timeout
        reserving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reserving
        await until(lambda: not store._orphans, 5, "the orphaned call's end")
        assert await day_counter(direct, "acme") == 800  # Redis ran it: its answer was lost
        link.delay_s = 0.0  # Redis answers in time again

        async def taken_back() -> bool:
            return await day_counter(direct, "acme") == 0

        await polls_until(taken_back, 100, "the reservation taken back")
        await book.stop()
        await store.close()
    await direct.aclose()


@pytest.mark.parametrize("client_leaves", [True, False])
async def test_an_admission_that_times_out_after_redis_ran_it_leaves_no_slot_taken(
    redis_server: RedisServer, client_leaves: bool
) -> None:
    """An admission's call times out (Redis slower than the call timeout) though Redis ran
    the script: its concurrency lease is taken out by its member, whether the client left
    meanwhile (the orphan's failure) or waited (decided locally). Before, the lease stayed
    until ``lease_ttl_s``: with ``max_concurrent: 1`` the tenant was refused on every replica
    that long for a request that never ran there."""
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    direct = Redis.from_url(redis_server.url, socket_timeout=5)
    acme = Tenant(name="acme", tier="normal", keys=[{"sha256": "0" * 64}], max_concurrent=1)
    async with SlowReplies(port) as link:
        config = SharedState(
            url=link.url,
            call_timeout_s=REPLY_DELAY_S / 2,
            probe_interval_s=0.1,
            lease_ttl_s=60.0,  # the lease's own end is not what frees the slot here
            max_connections=2,
        )
        store = SharedStore(config, CollectorRegistry())
        link.delay_s = 0.0
        await warm(store)
        await store.redis.script_load(ADMIT.source)
        limits = SharedLimitRegistry(store)
        limits.configure([acme], time.monotonic())
        limits.start()  # as served: its renewals take released leases out
        leases = limits._keys("acme")[2]
        link.delay_s = REPLY_DELAY_S  # the answer comes past the call timeout
        admitting = asyncio.create_task(limits.admit("acme", 10, 0.0))
        running: set[str] = set()  # the leases Redis should hold in the end
        if client_leaves:
            await asyncio.sleep(REPLY_DELAY_S / 4)  # sent; the client leaves before the timeout
            admitting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await admitting
        else:
            verdict = await admitting
            assert verdict.allowed and verdict.hold  # decided without Redis: it runs here
            running = {limits._held[verdict.hold].member}
        assert await direct.zcard(leases) == 1  # Redis ran it: the lease is there
        link.delay_s = 0.0  # Redis answers in time again

        async def holds(members: set[str]) -> bool:
            found = await direct.zrange(leases, 0, -1)
            return {m.decode() if isinstance(m, bytes) else str(m) for m in found} == members

        # The timed-out admission's lease goes; one admitted locally that runs is in Redis (red
        # team, stop 59: it reused the timed-out one's name, and was taken out with it).
        await polls_until(lambda: holds(running), 100, "the leases of what runs, and no other")
        if not client_leaves:
            for _ in range(3):  # renewals come and go: it stays
                await asyncio.sleep(0.5)
                assert await holds(running)
            limits.settle("acme", 10, 10, 0.0, verdict.hold)
            await polls_until(lambda: holds(set()), 100, "its lease taken out once it ended")
        await limits.stop()
        await store.close()
    await direct.aclose()
