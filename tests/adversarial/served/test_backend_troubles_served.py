"""What one backend (or one tenant's requests) can do to the others, against `tierproxy serve`
on its default loop with realistic clients from the kit (findings #11, #12, #21 of the second
attack report). Each backend is the fake vLLM (``FakeVLLM``) on a thread of the test process:
a chat whose content is "poison" kills its engine (vLLM's EngineDeadError, and /health failing
after), "hold" waits at a gate the test opens, and /metrics can be made huge.
The in-process twins: tests/adversarial/test_relay_faults.py, tests/unit/test_monitor.py and
tests/unit/test_best_tier_reserve.py."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import exchange, json_request
from proxy.bench.hostile.served import (
    ADMIN_KEY,
    NullBackend,
    ServedFleet,
    ServedProxy,
    admin_sections,
)
from proxy.bench.inproc import KEYS, make_config
from tests.helpers.timing import polls_until

LOAD = 'vllm:num_requests_running{engine="0"} 0\nvllm:num_requests_waiting{engine="0"} 0\n'


class Engine(NullBackend):
    """The fake vLLM on a thread of its own: "poison" kills it, "hold" waits until
    ``release()``."""

    def __init__(self) -> None:
        self.held = asyncio.Event()  # waited on this backend's loop; opened by release()
        super().__init__(FakeVLLM(poison="poison", metrics_text=LOAD, script=self._hold))

    async def _hold(self, request: web.Request, n: int) -> None:
        if (await request.json())["messages"][0]["content"] == "hold":
            await self.held.wait()

    @property
    def chats(self) -> int:
        return len(self.null.received)

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.held.set)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    started = [Engine().start() for _ in range(3)]
    try:
        yield started
    finally:
        for engine in started:
            engine.release()
            engine.stop()


@pytest.fixture
def served_over(tmp_path: Path) -> Iterator[Any]:
    with ServedFleet(tmp_path) as fleet:

        def start(backends: list[dict[str, Any]], **sections: Any) -> ServedProxy:
            config = make_config(backends, **admin_sections(), **sections)
            config["backend_health"] = {
                "health_interval_s": 0.5,
                "metrics_interval_s": 0.5,
                **config.get("backend_health", {}),
            }
            return fleet.start(config)

        yield start


def chat(tier: str, content: str) -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return json_request("/v1/chat/completions", body, KEYS[tier])


async def admin_metrics(proxy: ServedProxy) -> str:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"{proxy.admin_url}/metrics", headers=headers, timeout=aiohttp.ClientTimeout(10)
        ) as resp,
    ):
        return await resp.text()


async def test_a_request_that_kills_an_engine_kills_only_one(
    engines: list[Engine], served_over: Any
) -> None:
    proxy = served_over([{"url": e.url, "max_inflight": 4} for e in engines])
    resp = await exchange(proxy.host, proxy.port, chat("low", "poison"), timeout_s=20)
    assert resp.status == 502 and orjson.loads(resp.body)["error"]["code"] == "engine_dead"
    assert sum(e.null.dead for e in engines) == 1 and sum(e.chats for e in engines) == 1
    assert proxy.count(r"engine died running it alone; not retried") == 1
    # The other engines still serve (the dead one is ejected, or its retry goes elsewhere).
    for _ in range(4):
        ok = await exchange(proxy.host, proxy.port, chat("high", "hi"), timeout_s=20)
        assert ok.status == 200, ok.body


async def test_the_best_tier_is_served_past_a_room_full_of_a_worse_tier(
    engines: list[Engine], served_over: Any
) -> None:
    engine = engines[0]
    # A queue timeout no stall of a busy proxy reaches while the reserve serves it (3 s once).
    tiers = {"high": {"queue_timeout_s": 15}}
    proxy = served_over([{"url": engine.url, "max_inflight": 2}], tiers=tiers)
    holds = [
        asyncio.create_task(exchange(proxy.host, proxy.port, chat("low", "hold"), timeout_s=30))
        for _ in range(3)
    ]
    deadline = time.monotonic() + 10
    while engine.chats < 2:  # the room (2) is full of the low tier; its third call queues
        assert time.monotonic() < deadline, "the low tier's calls never reached the engine"
        await asyncio.sleep(0.05)
    # Without the reserve it would queue behind the held calls until its queue timeout (15 s)
    # and get a 503: its status tells, not a wall-clock bound a busy machine can stretch.
    high = await exchange(proxy.host, proxy.port, chat("high", "hi"), timeout_s=60)
    assert high.status == 200, (high.status, high.body)
    normal = asyncio.create_task(
        exchange(proxy.host, proxy.port, chat("normal", "hi"), timeout_s=30)
    )
    await asyncio.sleep(0.5)
    assert engine.chats == 3  # a worse tier never takes the reserve: 2 low held, 1 high
    engine.release()
    for task in [*holds, normal]:
        assert (await task).status == 200


async def test_one_backends_huge_metrics_is_cut_and_counted(
    engines: list[Engine], served_over: Any
) -> None:
    broken, healthy = engines[0], engines[1]
    backends = [{"url": broken.url, "max_inflight": 4}, {"url": healthy.url, "max_inflight": 4}]
    proxy = served_over(backends)  # the default cap (backend_health.max_metrics_bytes, 4 MiB)

    async def chat_times_s(chats: int) -> list[float]:
        times = []
        for _ in range(chats):
            started = time.monotonic()
            resp = await exchange(proxy.host, proxy.port, chat("high", "hi"), timeout_s=10)
            times.append(time.monotonic() - started)
            assert resp.status == 200
            await asyncio.sleep(0.25)
        return times

    quiet = statistics.median(await chat_times_s(5))  # this machine, this load, sane /metrics
    broken.null.metrics_padding_bytes = 48 * 1024 * 1024  # a broken exporter: 48 MB every scrape
    rss_before = proxy.rss_bytes()
    times = await chat_times_s(20)  # 5 s: about ten scrapes of the broken backend

    async def three_oversize() -> bool:  # the broken backend's scrapes refused as oversize
        return any(
            line.startswith("tierproxy_backend_probe_failures_total{")
            and 'reason="oversize"' in line
            and broken.url in line
            and float(line.rsplit(" ", 1)[1]) >= 3
            for line in (await admin_metrics(proxy)).splitlines()
        )

    # Three counted, however few scrapes a busy machine ran in the chats' 5 s (quiet: ten).
    await polls_until(three_oversize, 600, "three oversize scrapes counted")
    # On the lockstep monitor that read it whole: seconds of stall every scrape, most chats
    # slow. Counted against the quiet figure of the same test (a busy machine slows both), and
    # a few allowed: one stall of a busy host is one slow chat, not a stalled proxy.
    slow = [round(t, 2) for t in times if t > max(1.0, 10 * quiet)]
    assert len(slow) <= 3, (slow, quiet)
    assert proxy.rss_bytes() - rss_before < 32 * 1024 * 1024
    assert proxy.count(r"its /metrics answer passed 4194304 bytes") == 1
