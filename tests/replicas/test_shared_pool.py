"""Waiting for a pooled Redis connection is not a Redis timeout (issue 22): a burst of calls
larger than the pool, each well within ``call_timeout_s`` on a real redis-server, leaves Redis
up; the calls that found no connection in time are counted and decided without Redis. A call
that really times out still counts towards "down"."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.bench.redis_server import RedisServer
from proxy.config.shared_state import SharedState
from proxy.replicas.client import SharedStateBusy, SharedStateDown, SharedStore
from tests.helpers.shared_store import warm


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[Callable[..., Any]]:
    made: list[SharedStore] = []

    async def make(**cfg: Any) -> SharedStore:
        s = SharedStore(SharedState(url=redis_server.url, **cfg), CollectorRegistry())
        await warm(s)
        made.append(s)
        return s

    yield make
    for s in made:
        await s.close()


def slow_call(seconds: float) -> Callable[[Any], Any]:
    """A healthy call that holds its connection ``seconds`` (BLPOP on an empty list blocks
    only its own connection, never the server)."""
    return lambda redis: redis.blpop(["tierproxy-test-empty"], timeout=seconds)


async def test_a_burst_past_the_pool_leaves_a_healthy_redis_up(store: Any) -> None:
    # The calls' own timeout far past their 0.1 s (0.25 s once: a busy host's stall of 0.15 s
    # timed a healthy call out, a SharedStateDown); only the pool's wait is short.
    s = await store(max_connections=2, call_timeout_s=5.0, pool_wait_s=0.25)
    # 20 calls of 0.1 s each on 2 connections: the last wait a second for one.
    results = await asyncio.gather(
        *(s.call(slow_call(0.1)) for _ in range(20)), return_exceptions=True
    )
    done = [r for r in results if not isinstance(r, BaseException)]
    busy = [r for r in results if isinstance(r, SharedStateBusy)]
    assert len(done) + len(busy) == 20, results  # no other failure
    assert 2 <= len(done) <= 8 and busy
    assert s.up and s.fallback._value.get() == 0  # was marked down after 3 "timeouts"
    assert s.pool_timeouts._value.get() == len(busy)
    assert await s.call(lambda redis: redis.ping())  # and still answers


async def test_calls_that_time_out_on_their_own_still_mark_redis_down(store: Any) -> None:
    # A connection is free at once (one call at a time): a long pool wait cannot be what fails.
    s = await store(max_connections=4, call_timeout_s=0.1, pool_wait_s=5.0)
    for _ in range(3):  # each has a connection at once, and Redis is slower than the timeout
        with pytest.raises(SharedStateDown) as raised:
            await s.call(slow_call(0.5))
        assert not isinstance(raised.value, SharedStateBusy)
    assert not s.up and s.fallback._value.get() == 1
    assert s.pool_timeouts._value.get() == 0
