"""Quotas through `tierproxy serve` (uvloop, the C parser), with and without shared state in a
real redis-server: the refusal's shape and Retry-After to the next UTC midnight on the real
wall clock; with Redis, a second replica refuses what the first used."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import Response, exchange, is_openai_error, json_request
from proxy.bench.hostile.served import NullBackend
from proxy.bench.inproc import KEYS
from proxy.bench.redis_server import RedisServer
from proxy.config.scheduling import Limits, Scheduling
from proxy.config.tenants import Tier
from proxy.request.inbound import parse_body
from proxy.scheduling.quotas import period
from tests.helpers.replicas import day_counter
from tests.helpers.timing import polls_until

BODY = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# What a quota reserves for BODY: its prompt's upper bound (its bytes) and max_tokens.
TIER = Tier(priority=5, weight=5, max_queue=10, queue_timeout_s=60, request_timeout_s=120)
WORST = parse_body(orjson.dumps(BODY), "chat", TIER, Limits(), Scheduling()).prompt_upper_bound + 4
QUOTA = {"tokens_per_day": WORST + 16}  # the backend reports 4 + 4 tokens an answer


@pytest.fixture
def backend() -> Iterator[NullBackend]:
    with NullBackend(FakeVLLM(model="null", usage=(4, 4))) as upstream:
        yield upstream


async def chat(proxy: Any) -> Response:
    request = json_request("/v1/chat/completions", BODY, KEYS["normal"])
    return await exchange(proxy.host, proxy.port, request)


def assert_quota_refusal(answer: Response) -> None:
    assert answer.status == 429 and is_openai_error(answer), answer.body
    assert answer.error_code() == "quota_exceeded"
    assert answer.headers["x-should-retry"] == "false"
    to_midnight = period("day", time.time())[1] - time.time()
    assert abs(int(answer.headers["retry-after"]) - to_midnight) <= 2, answer.headers


async def first_refusal(proxy: Any) -> tuple[int, Response]:
    for answered in range(10):
        answer = await chat(proxy)
        if answer.status != 200:
            return answered, answer
    raise AssertionError("never refused")


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "local"])
async def test_a_used_up_daily_quota_is_429_until_midnight(start: Any, shared: bool) -> None:
    proxy = start(shared=shared, quota=QUOTA)
    answered, refused = await first_refusal(proxy)
    # 8 tokens an answer settled, each reserving its worst case: up to 3 fit in WORST + 16
    # (with shared state a settle lands in Redis a moment later: the next request may still
    # meet the last one's whole reservation).
    assert answered in ((1, 2, 3) if shared else (2, 3))
    assert_quota_refusal(refused)


async def test_a_second_replica_refuses_what_the_first_used(
    start: Any, redis_server: RedisServer
) -> None:
    a = start(quota=QUOTA)
    b = start(quota=QUOTA)
    redis = Redis.from_url(redis_server.url)
    try:

        async def settled(answered: int) -> None:  # Redis holds their usage, no reservation
            async def landed() -> bool:
                return await day_counter(redis) == answered * 8

            await polls_until(landed, 600, f"the settles of {answered} answers in Redis")

        answered, _ = await first_refusal(a)
        # A refusal may come of the last answer's settle still on its way to Redis (its whole
        # reservation counted): once it landed, the quota is used up for good. Waited for in
        # Redis, not slept on (0.3 s once: a busy host's settle came later).
        await settled(answered)
        while (await chat(a)).status == 200:
            answered += 1
            await settled(answered)
    finally:
        await redis.aclose()
    assert answered in (2, 3)
    assert_quota_refusal(await chat(b))
