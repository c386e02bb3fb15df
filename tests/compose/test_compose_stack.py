"""The CPU compose stack driven from the host as a client and an operator would: a request per
tier through HAProxy, a stream, a 429 from a full queue, a key revoked by editing the mounted
config and `docker-compose kill -s HUP`, the stack's own Prometheus scraping every target, a
replica drained by SIGTERM, and an engine container killed and started again without a request
lost. The tests run in this order on one stack (tests/compose/conftest.py)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.compose.conftest import Keys, Reporter, write_config
from tests.helpers.compose_stack import Stack

pytestmark = pytest.mark.compose

TIMEOUT = aiohttp.ClientTimeout(total=120)
PROMPT = [{"role": "user", "content": "hello there"}]


async def chat(
    session: aiohttp.ClientSession, base: str, key: str, **body: Any
) -> tuple[int, dict[str, Any], dict[str, str]]:
    payload = {"model": "tiny", "max_tokens": 8, "messages": PROMPT, **body}
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(f"{base}/v1/chat/completions", json=payload, headers=headers) as r:
        answer = await r.json(content_type=None)
        return r.status, answer, dict(r.headers)


async def test_a_request_per_tier_through_haproxy(stack: Stack, keys: Keys) -> None:
    base = stack.url("haproxy", 8000)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        for key in (keys.high, keys.normal, keys.low):
            status, answer, _ = await chat(s, base, key)
            assert status == 200, answer
            assert answer["usage"]["completion_tokens"] > 0
        status, answer, _ = await chat(s, base, "tp-not-a-key")
        assert status == 401, answer


async def test_a_stream_arrives_event_by_event(stack: Stack, keys: Keys) -> None:
    payload = {"model": "tiny", "max_tokens": 16, "messages": PROMPT, "stream": True}
    headers = {"Authorization": f"Bearer {keys.normal}"}
    url = f"{stack.url('haproxy', 8000)}/v1/chat/completions"
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as s,
        s.post(url, json=payload, headers=headers) as r,
    ):
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [line async for line in r.content if line.startswith(b"data: ")]
    assert len(events) > 2
    assert events[-1].strip() == b"data: [DONE]"


async def test_a_full_queue_answers_429(stack: Stack, keys: Keys) -> None:
    # Four slots in all (two per engine, shared by the replicas through Redis), one queued
    # batch request: a burst of 16 long ones overflows the low tier's queue.
    base = stack.url("haproxy", 8000)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        burst = [chat(s, base, keys.low, max_tokens=150, ignore_eos=True) for _ in range(16)]
        answers = await asyncio.gather(*burst)
    statuses = Counter(status for status, _, _ in answers)
    assert statuses[429] > 0 and statuses[200] > 0, statuses
    assert set(statuses) <= {200, 429}, statuses
    refused = next(headers for status, _, headers in answers if status == 429)
    assert int(refused["Retry-After"]) >= 1


async def test_a_key_revoked_in_the_mounted_config_on_sighup(
    stack: Stack, keys: Keys, config_dir: Path
) -> None:
    base = stack.url("haproxy", 8000)
    replicas = [stack.url(name, 8000) for name in ("proxy", "proxy-2")]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        for replica in replicas:
            assert (await chat(s, replica, keys.revocable))[0] == 200
        write_config(config_dir, keys, revoked=True)
        stack.compose("kill", "-s", "HUP", "proxy", "proxy-2")
        for replica in replicas:
            assert await eventually_status(s, replica, keys.revocable, 401, within_s=20)
        # The tenant's other key, and the stack, still serve.
        assert (await chat(s, base, keys.high))[0] == 200


async def eventually_status(
    s: aiohttp.ClientSession, base: str, key: str, wanted: int, within_s: float
) -> bool:
    deadline = time.monotonic() + within_s
    while (await chat(s, base, key))[0] != wanted:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.5)
    return True


async def test_the_stacks_prometheus_scrapes_every_target(stack: Stack) -> None:
    prometheus = stack.url("prometheus", 9090)
    wanted = {"proxy:8001", "proxy-2:8001", "vllm-0:8000", "vllm-1:8000"}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        deadline = time.monotonic() + 60
        while True:
            up = await query(s, prometheus, "up == 1")
            served = await query(s, prometheus, "sum by (instance) (tierproxy_requests_total)")
            if {r["metric"]["instance"] for r in up} == wanted and served:
                break
            assert time.monotonic() < deadline, (up, served)
            await asyncio.sleep(2)
        # The project's alert rules load into the stack's Prometheus.
        async with s.get(f"{prometheus}/api/v1/rules") as r:
            groups = (await r.json())["data"]["groups"]
    assert groups and all(g["rules"] for g in groups)
    assert {r["metric"]["instance"] for r in served} <= {"proxy:8001", "proxy-2:8001"}


async def query(s: aiohttp.ClientSession, prometheus: str, expr: str) -> list[dict[str, Any]]:
    async with s.get(f"{prometheus}/api/v1/query", params={"query": expr}) as r:
        result: list[dict[str, Any]] = (await r.json())["data"]["result"]
        return result


async def test_sigterm_drains_a_replica_under_init(stack: Stack, keys: Keys) -> None:
    # Straight to proxy-2: its request in flight finishes while `stop` (SIGTERM through init)
    # waits for it; then it starts again and takes traffic.
    replica = stack.url("proxy-2", 8000)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        long = asyncio.create_task(chat(s, replica, keys.high, max_tokens=300, ignore_eos=True))
        await asyncio.sleep(1.0)
        await asyncio.to_thread(stack.compose, "stop", "--timeout", "60", "proxy-2")
        status, answer, _ = await long
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == 300
    stack.compose("start", "proxy-2")
    stack.wait_healthy(("proxy-2",), within_s=60)


async def test_an_engine_killed_and_restarted_loses_no_request(
    stack: Stack, keys: Keys, pytestconfig: pytest.Config
) -> None:
    base = stack.url("haproxy", 8000)
    statuses: Counter[int] = Counter()
    stop = asyncio.Event()

    async def client(s: aiohttp.ClientSession, key: str) -> None:
        while not stop.is_set():
            try:
                statuses[(await chat(s, base, key, max_tokens=32, ignore_eos=True))[0]] += 1
            except aiohttp.ClientError:
                statuses[0] += 1  # lost: no answer at all

    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        clients = [asyncio.create_task(client(s, k)) for k in (keys.high, keys.normal) * 2]
        try:
            during = await kill_and_restart(stack, s, statuses)
            stop.set()
            await asyncio.gather(*clients)
        finally:
            for task in clients:  # a failed step leaves none running past the session
                task.cancel()
    assert during > 0
    # Nothing lost: a request on the engine as it dies is retried on the other one, including
    # one written into a kept-alive connection to the vanished container (no reset comes: the
    # proxy's upstream sockets close after backend_health.dead_connection_s).
    Reporter(pytestconfig)(
        f"engine killed mid-load: {sum(statuses.values())} requests (0: no answer)"
        f" ({during} before its restart), statuses {dict(statuses)}"
    )
    assert set(statuses) == {200}, statuses


async def kill_and_restart(stack: Stack, s: aiohttp.ClientSession, statuses: Counter[int]) -> int:
    """vllm-0's server killed under the clients' load, its container started again and back
    in service; how many requests were answered before the restart."""
    await asyncio.sleep(3)
    # The engine's server SIGKILLed mid-generation, as the OOM killer does: the kernel closes
    # its connections and its container exits. (`docker kill` of the whole container takes its
    # network away without a reset: a request written into a kept-alive connection to it fails
    # after backend_health.dead_connection_s and is retried on the other engine.)
    kill = "kill -9 $(cat /proc/1/task/1/children)"  # init's child: vLLM's API server
    await asyncio.to_thread(stack.compose, "exec", "-T", "vllm-0", "sh", "-c", kill)
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(stack.health, "vllm-0") != "exited":  # then start it
        assert time.monotonic() < deadline, "the engine's container did not exit"
        await asyncio.sleep(0.5)
    await asyncio.sleep(3)
    during = sum(statuses.values())
    await asyncio.to_thread(stack.restart_engine, "vllm-0", 600)
    served_before = await engine_successes(s, stack.url("vllm-0", 8000))
    deadline = time.monotonic() + 60
    while await engine_successes(s, stack.url("vllm-0", 8000)) <= served_before:
        assert time.monotonic() < deadline, "the restarted engine got no request back"
        await asyncio.sleep(1)
    return during


async def engine_successes(s: aiohttp.ClientSession, engine: str) -> float:
    async with s.get(f"{engine}/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )
