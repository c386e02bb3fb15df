"""A tenant that reuses one ``X-Request-Id`` against `tierproxy serve` (uvloop, C parser) with
shared state in a real redis-server: its limits hold, its usage is debited and, with Redis gone
(``on_failure: local``), no local slot leaks. The registry keys an admission by an id it makes
itself, never by the client's header (issue 22)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import Response, exchange, json_request
from proxy.bench.hostile.served import NullBackend, ServedProxy
from proxy.bench.inproc import KEYS
from proxy.bench.redis_server import RedisServer
from tests.helpers.replicas import TENANT

REUSED = "same-id-every-time"
USED = 450  # total_tokens the backend reports for every answer


@pytest.fixture
def backend() -> Iterator[NullBackend]:
    """Each answer takes 0.6 s (so requests overlap) and reports ``USED`` tokens."""
    fake = FakeVLLM(model="null", delay_s=0.6, usage=(50, USED - 50))
    with NullBackend(fake) as upstream:
        yield upstream


async def chat(proxy: ServedProxy, request_id: str | None, max_tokens: int = 1) -> Response:
    body = {"model": "null", "messages": [{"role": "user", "content": "hi"}]}
    body["max_tokens"] = max_tokens  # type: ignore[assignment]
    extra = {"X-Request-Id": request_id} if request_id else {}
    request = json_request("/v1/chat/completions", body, KEYS["normal"], extra)
    return await exchange(proxy.host, proxy.port, request)


async def burst(proxy: ServedProxy, n: int, request_id: str | None) -> Counter[int]:
    answers = await asyncio.gather(*(chat(proxy, request_id) for _ in range(n)))
    return Counter(a.status for a in answers)


def leases(server: RedisServer) -> int:
    client = redis.Redis.from_url(server.url, socket_timeout=5)
    try:
        return int(client.zcard(f"tierproxy:v2:limit:{{{TENANT}}}:concurrent"))
    finally:
        client.close()


async def settled(server: RedisServer) -> None:
    """A lease goes back to Redis just after the answer (a task of its own): wait for it."""
    for _ in range(100):
        if leases(server) == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{leases(server)} leases still held")


def tpm_level(server: RedisServer) -> float:
    client = redis.Redis.from_url(server.url, socket_timeout=5)
    try:
        level = client.hget(f"tierproxy:v2:limit:{{{TENANT}}}:tpm", "level")
    finally:
        client.close()
    return float(level) if level is not None else float("inf")


async def test_a_reused_request_id_does_not_lift_max_concurrent(
    start: Any, backend: NullBackend, redis_server: RedisServer
) -> None:
    proxy = start(max_concurrent=2)
    statuses = await burst(proxy, 6, REUSED)
    assert statuses == Counter({200: 2, 429: 4}), statuses  # was 6 of 6
    assert backend.null.max_active <= 2
    # Every lease came back: the next pair runs too.
    await settled(redis_server)
    assert await burst(proxy, 2, REUSED) == Counter({200: 2})


async def test_without_shared_state_a_reused_id_changes_nothing_either(
    start: Any, backend: NullBackend
) -> None:
    """The process's own registry counts per tenant (one settle per admission, the pipeline's
    ``finally``): no id reaches it. Kept so that it stays so."""
    proxy = start(shared=False, max_concurrent=2)
    assert await burst(proxy, 6, REUSED) == Counter({200: 2, 429: 4})
    assert await burst(proxy, 2, REUSED) == Counter({200: 2})


async def test_usage_past_the_reservation_is_debited_for_every_request(
    start: Any, redis_server: RedisServer
) -> None:
    proxy = start(tokens_per_minute=1000)
    assert await burst(proxy, 2, REUSED) == Counter({200: 2})
    # Each reserved a few tokens and used 450: both debits reach Redis (1,000 - 900 = 100, and
    # the refill of 16.7/s). With one id, the second settle was dropped (level stayed > 540).
    for _ in range(100):
        if tpm_level(redis_server) < 300:
            break
        await asyncio.sleep(0.05)
    assert tpm_level(redis_server) < 300, tpm_level(redis_server)
    refused = await chat(proxy, REUSED, max_tokens=300)
    assert refused.status == 429 and refused.error_code() == "rate_limit_exceeded", refused


async def test_with_redis_down_no_local_slot_leaks(
    start: Any, redis_server: RedisServer, backend: NullBackend
) -> None:
    proxy = start(max_concurrent=2)
    assert await burst(proxy, 1, None) == Counter({200: 1})  # the pool is warm and used
    redis_server.kill()
    # Decided by the replica's own limits (on_failure: local), both under one id.
    assert await burst(proxy, 2, REUSED) == Counter({200: 2})
    # Both settled: the tenant's two local slots are free again (one leaked for good before).
    for _ in range(3):
        assert await burst(proxy, 2, None) == Counter({200: 2})
    assert await burst(proxy, 3, None) == Counter({200: 2, 429: 1})
