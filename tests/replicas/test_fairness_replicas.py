"""Global fairness end to end: two real proxy processes share one Redis and meter one null
upstream of 4 slots (each request holds a slot 80 ms). A heavy tenant sends through both
replicas, a light one through replica A only, each far over capacity (both always backlogged).
With shared counters A sees the heavy tenant's service on B and gives its slots to the light
one: one share each (Jain >= 0.95). Without sharing them, A splits its half evenly and the light
tenant gets a quarter (Jain 0.8): the baseline."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import make_config
from proxy.bench.redis_server import RedisServer
from proxy.config.tenants import hash_key
from tests.helpers.replicas import start_replicas

KEYS = {"heavy": "key-heavy", "light": "key-light"}


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


async def served_shares(
    redis_server: RedisServer, tmp_path: Path, *, share_fairness: bool, seconds: float = 4.0
) -> dict[str, int]:
    null = FakeVLLM(model="null", usage=(4, 4), delay_s=0.08)
    async with null.serve() as url:
        tenants = [
            {"name": name, "tier": "normal", "keys": [{"sha256": hash_key(key)}]}
            for name, key in KEYS.items()
        ]
        shared: dict[str, Any] = {"url": redis_server.url, "priority_reserve": 0}
        if not share_fairness:
            shared["sync_interval_s"] = 3600.0  # never merged within the run
        config = make_config(
            [{"url": url, "max_inflight": 4}], tenants=tenants, shared_state=shared
        )
        a, b = await start_replicas(2, config, tmp_path)
        stop_at = time.monotonic() + seconds
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:

                async def client(base: str, tenant: str) -> None:
                    body = {
                        "model": "null",
                        "user": tenant,
                        "messages": [{"role": "user", "content": "x"}],
                    }
                    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
                    while time.monotonic() < stop_at:
                        async with s.post(
                            f"{base}/v1/chat/completions", json=body, headers=headers
                        ) as r:
                            await r.read()
                            assert r.status == 200, r.status

                await asyncio.gather(
                    *(client(a.url, "heavy") for _ in range(6)),
                    *(client(b.url, "heavy") for _ in range(6)),
                    *(client(a.url, "light") for _ in range(6)),
                )
        finally:
            a.stop()
            b.stop()
        assert null.max_active <= 4
        return dict(null.served_by_user)


async def test_a_tenant_on_two_replicas_gets_one_share(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    served = await served_shares(redis_server, tmp_path, share_fairness=True)
    assert jain([served["heavy"], served["light"]]) >= 0.95, served


async def test_without_shared_counters_it_gets_two(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    served = await served_shares(redis_server, tmp_path, share_fairness=False)
    assert jain([served["heavy"], served["light"]]) < 0.9, served
