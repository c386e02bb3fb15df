"""The adaptive room on a real vLLM (--max-num-seqs 4), with nothing tuned by hand."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import CORE
from tests.helpers.proxyrun import auth, make_config, running_proxy

pytestmark = [pytest.mark.integration, pytest.mark.engines(CORE)]
TIMEOUT = aiohttp.ClientTimeout(total=60)
BODY: dict[str, Any] = {
    "model": "tiny",
    "max_tokens": 48,
    "ignore_eos": True,
    "messages": [{"role": "user", "content": "hi"}],
}


async def test_room_learns_the_engine_batch_without_max_inflight(engines: EngineFarm) -> None:
    engine = engines.get(CORE)  # --max-num-seqs 4
    cfg = make_config(
        [{"url": engine.spec.url}],  # no max_inflight: the room adapts
        tiers={"high": {"slo": {"ttft_s": 30.0}}, "normal": {"slo": {"ttft_s": 30.0}}},
        # The room controller alone: the best tier's reserve would add a request past the room
        # whenever the normal tier fills it, and vLLM's queue by as much.
        scheduling={"best_tier_reserve": 0},
    )
    statuses: list[int] = []
    async with running_proxy(cfg) as (base, state), aiohttp.ClientSession(timeout=TIMEOUT) as s:
        (backend,) = state.pool.all()
        assert backend.max_room == 8  # adaptive_room.initial_room
        stop_at = time.monotonic() + 8.0

        async def client(tier: str) -> None:
            while time.monotonic() < stop_at:
                async with s.post(
                    f"{base}/v1/chat/completions", json=BODY, headers=auth(tier)
                ) as r:
                    await r.read()
                    statuses.append(r.status)

        rooms: list[float] = []
        waiting: list[float] = []  # vLLM's own queue, as the monitor scraped it

        async def watch() -> None:
            while time.monotonic() < stop_at:
                rooms.append(backend.max_room)
                if backend.load is not None:
                    waiting.append(backend.load.waiting)
                await asyncio.sleep(0.25)

        await asyncio.gather(watch(), *(client("high" if i < 4 else "normal") for i in range(16)))

        def sample(name: str, labels: dict[str, str]) -> float:
            return state.metrics.registry.get_sample_value(name, labels) or 0.0

        high = {"tier": "high", "tenant": "tenant-high"}
        counted = sample("tierproxy_slo_requests_total", high)
        met = sample("tierproxy_slo_met_total", high)
    assert statuses and set(statuses) == {200}
    # 16 clients keep a backlog at the proxy; the room settles at what vLLM runs (4) plus the
    # allowance (backend_health.max_backend_waiting, 2) plus the requests in transit through
    # vLLM's API server (a few here), so that vLLM's own queue stays at about the allowance
    # instead of taking the 16 clients' ordering away from the tiers.
    later = len(rooms) // 2
    assert 4 <= rooms[-1] <= 10, rooms
    assert max(rooms[later:]) - min(rooms[later:]) <= 2, rooms
    assert sum(waiting[later:]) / len(waiting[later:]) <= 3.0, (waiting, rooms)
    assert counted > 0 and met == counted
