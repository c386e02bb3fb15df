"""Two proxy replicas sharing one Redis meter ONE real vLLM engine: their combined in-flight
work, read from vLLM's own num_requests_running + num_requests_waiting, never exceeds the
backend's room, every request completes, and the room is used in full (work-conserving)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import pytest

from proxy.bench.inproc import auth, make_config, running_proxy, until
from proxy.bench.redis_server import RedisServer
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import CORE

pytestmark = [pytest.mark.integration, pytest.mark.engines(CORE)]
TIMEOUT = aiohttp.ClientTimeout(total=180)
ROOM = 3
# Generations that hold the full room far past the polls that see it, however fast the engine
# decodes (a fast machine ran the 16-token waves between two polls); their clients then leave.
LONG_TOKENS = 12_000
GAUGE = re.compile(r"^vllm:num_requests_(running|waiting)\{[^}]*\} ([0-9.e+]+)$", re.M)


async def engine_load(s: aiohttp.ClientSession, url: str) -> float:
    async with s.get(f"{url}/metrics") as r:
        text = await r.text()
    return sum(float(v) for _, v in GAUGE.findall(text))


async def test_two_replicas_never_run_more_than_the_engines_room(
    engines: EngineFarm, tmp_path: Path
) -> None:
    engine = engines.get(CORE)
    if not RedisServer.available():
        pytest.skip("redis-server is not installed (make test installs it)")
    redis = RedisServer(tmp_path)
    redis.start()
    cfg = make_config(
        [{"url": engine.spec.url, "max_inflight": ROOM}],
        # What is tested is metering with Redis up: a host busy with the engine must not time
        # calls out into local limits (tests/replicas/test_shared_pool.py tests that).
        shared_state={"url": redis.url, "priority_reserve": 0, "call_timeout_s": 2.0},
    )
    body = {
        "model": "tiny",
        "max_tokens": 16,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    try:
        async with (
            running_proxy(cfg) as (base_a, state_a),
            running_proxy(cfg) as (base_b, state_b),
            aiohttp.ClientSession(timeout=TIMEOUT) as s,
        ):
            peak = 0.0
            samples = 0
            done = asyncio.Event()

            async def watch() -> None:
                nonlocal peak, samples
                while not done.is_set():
                    peak = max(peak, await engine_load(s, engine.spec.url))
                    samples += 1
                    await asyncio.sleep(0.02)

            async def call(base: str, max_tokens: int = 16) -> int:
                async with s.post(
                    f"{base}/v1/chat/completions",
                    json={**body, "max_tokens": max_tokens},
                    headers=auth("normal"),
                ) as r:
                    await r.read()
                    return r.status

            watcher = asyncio.create_task(watch())
            long: list[asyncio.Task[int]] = []
            try:
                statuses = await asyncio.gather(
                    *(call(base_a if i % 2 else base_b) for i in range(12))
                )
                # Twice the room offered, through both replicas: the room in full lasts.
                long = [
                    asyncio.create_task(call(base_a if i % 2 else base_b, LONG_TOKENS))
                    for i in range(2 * ROOM)
                ]
                # The room seen full and the rest held in the proxies' queues; then a few more
                # samples (vLLM's gauges trail its scheduler by a step).
                await until(
                    lambda: peak >= ROOM and len(state_a.queue) + len(state_b.queue) == ROOM,
                    120,
                    "the engine running the full room, the rest queued",
                )
                seen = samples
                await until(lambda: samples >= seen + 5, 60, "five more samples")
            finally:
                done.set()
                await watcher
                for task in long:  # their clients leave: the proxies abort them in the engine
                    task.cancel()
                await asyncio.gather(*long, return_exceptions=True)
    finally:
        redis.kill()
    assert statuses == [200] * 12
    # vLLM's own gauges: never more than the room (one replica alone would also stay within
    # it; two without shared state could reach twice it), and the room was used in full.
    assert peak <= ROOM, peak
    assert peak == ROOM, peak
