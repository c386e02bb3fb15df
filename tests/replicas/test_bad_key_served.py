"""One tenant's counter holding a value of the wrong type (a rolling upgrade that changed a
key's format, an older replica, an operator's mistake), through `tierproxy serve` with a real
redis-server and ``on_failure: refuse``: that tenant alone is refused, counted and logged with
the key's name; every other tenant is served (issue 30: every tenant got 503)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import exchange, json_request
from proxy.bench.hostile.served import NullBackend
from proxy.bench.inproc import KEYS
from proxy.bench.redis_server import RedisServer
from proxy.scheduling.quotas import period
from tests.helpers.replicas import TENANT

BODY = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
QUOTA = {"tokens_per_day": 1_000_000}


@pytest.fixture
def backend() -> Iterator[NullBackend]:
    with NullBackend(FakeVLLM(model="null", usage=(4, 4))) as upstream:
        yield upstream


async def test_a_bad_counter_refuses_its_tenant_alone(
    start: Any, redis_server: RedisServer
) -> None:
    # A long probe interval: a Redis marked down would stay down for the whole test.
    proxy = start(
        state={"on_failure": "refuse", "probe_interval_s": 30},
        others=({"name": "beta", "quota": QUOTA},),
        quota=QUOTA,
    )
    day = period("day", time.time())[0]
    bad = f"tierproxy:v2:quota:{{{TENANT}}}:tokens_per_day:{day}"
    redis = Redis.from_url(redis_server.url)
    try:
        await redis.hset(bad, "used", "5")  # a hash where a number belongs
        acme = json_request("/v1/chat/completions", BODY, KEYS["normal"])
        beta = json_request("/v1/chat/completions", BODY, KEYS["high"])
        for _ in range(5):
            refused = await exchange(proxy.host, proxy.port, acme)
            assert refused.status == 503, refused.body
            assert refused.error_code() == "shared_state_unavailable"
            served = await exchange(proxy.host, proxy.port, beta)
            assert served.status == 200, served.body
        async with aiohttp.ClientSession() as http, http.get(f"{proxy.admin_url}/metrics") as m:
            metrics = await m.text()
        assert 'tierproxy_shared_state_bad_keys_total{kind="quota"} 5.0' in metrics
        assert proxy.count(bad) >= 1  # logged with the key's name
        assert "tierproxy_shared_state_fallback 0.0" in metrics  # Redis never marked down
    finally:
        await redis.aclose()
