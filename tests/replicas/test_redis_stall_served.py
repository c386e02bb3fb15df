"""A Redis that stalls past ``call_timeout_s`` while reservations are on their way (a snapshot
fork, a slow fsync: ``CLIENT PAUSE`` here), through `tierproxy serve` with a real redis-server:
the scripts the proxy gave up on still run once Redis resumes, and each is undone, so the day's
counter ends equal to what the served requests used — not that plus the worst case of every
request that timed out (issue 30: 5,104 counted for 2,736 used; 59 of 60 refused and charged)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from redis.asyncio import Redis

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import exchange, json_request
from proxy.bench.hostile.served import NullBackend
from proxy.bench.inproc import KEYS
from proxy.bench.redis_server import RedisServer
from tests.helpers.redis_server import stalled, until_stalled
from tests.helpers.replicas import day_counter

BODY = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400}
USED = 8  # the backend reports 4 + 4 tokens an answer
STALL_MS = 4000  # 24 requests all inside it, on a busy machine too
REQUESTS = 24


@pytest.fixture
def backend() -> Iterator[NullBackend]:
    with NullBackend(FakeVLLM(model="null", usage=(4, 4))) as upstream:
        yield upstream


async def settles_to(redis: Redis, expected: float, timeout_s: float = 8.0) -> float:
    """The counter once it equals ``expected`` (undos and settles land in the background), or
    its last value when it never does."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (value := await day_counter(redis)) != expected:
        if asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    return value


@pytest.mark.parametrize("on_failure", ["refuse", "local"])
async def test_a_stall_past_the_call_timeout_leaves_the_counter_at_what_was_used(
    start: Any, redis_server: RedisServer, on_failure: str
) -> None:
    proxy = start(
        state={"on_failure": on_failure, "call_timeout_s": 0.2},
        quota={"tokens_per_day": 10_000_000},
    )
    request = json_request("/v1/chat/completions", BODY, KEYS["normal"])
    redis = Redis.from_url(redis_server.url)
    try:
        assert (await exchange(proxy.host, proxy.port, request)).status == 200  # scripts loaded
        with stalled(redis_server, STALL_MS / 1000) as stall:
            await until_stalled(redis_server.url)
            answers = await asyncio.gather(
                *(exchange(proxy.host, proxy.port, request) for _ in range(REQUESTS))
            )
            served = 1 + sum(1 for a in answers if a.status == 200)
            statuses = sorted({a.status for a in answers})
            # Every reservation in the stall outlived the proxy's patience: each was decided
            # without Redis (503 with refuse, the local ledger with local); its script ran later.
            assert statuses == ([503] if on_failure == "refuse" else [200]), statuses
            await stall.over()  # Redis resumes and runs what it was sent
        # Once Redis answers again, another request: the proxy is back on shared state.
        for _ in range(100):
            answer = await exchange(proxy.host, proxy.port, request)
            if answer.status == 200:
                served += 1
                break
            await asyncio.sleep(0.05)
        counted = await settles_to(redis, served * USED)
        assert counted == served * USED, f"{counted} counted for {served} served"
    finally:
        await redis.aclose()
