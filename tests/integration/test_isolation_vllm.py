"""Prefix-cache isolation between tenants (docs/isolation.md) on real vLLM with
``--enable-prefix-caching``: read from vLLM's own ``vllm:prefix_cache_hits_total``.

One engine with the plugin (it checks the salt the ticket binds) and the suite's secret. Tenant
``tenant-high`` is alone; ``tenant-normal`` and ``tenant-low`` share the ``cache_group`` "team".
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import aiohttp
import pytest

from proxy.bench.inproc import SECRET, auth, make_config, running_proxy
from proxy.telemetry import prometheus
from proxy.ticket import derive_cache_salt
from proxy.tools.engine import EngineProcess
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import PREFIX_CACHE

pytestmark = [pytest.mark.integration, pytest.mark.engines(PREFIX_CACHE)]
TIMEOUT = aiohttp.ClientTimeout(total=60)
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"


@pytest.fixture(scope="module")
def engine(engines: EngineFarm) -> EngineProcess:
    return engines.get(PREFIX_CACHE)


def _prompt() -> str:
    """About 400 tokens no earlier run has cached (a fresh random head)."""
    return f"{secrets.token_hex(8)} " + " ".join(f"word{i % 97}" for i in range(200))


class Counters:
    def __init__(self, session: aiohttp.ClientSession, engine_url: str) -> None:
        self.session, self.url = session, engine_url
        self.hits = self.queries = 0.0

    async def read(self) -> tuple[float, float]:
        async with self.session.get(f"{self.url}/metrics") as resp:
            text = await resp.text()
        return prometheus.total(text, HITS), prometheus.total(text, QUERIES)

    async def hit_by(self, send: Any) -> float:
        """Cache hits (tokens) one request added, once vLLM counted its query."""
        self.hits, self.queries = await self.read()
        await send()
        latest: list[tuple[float, float]] = []

        async def counted() -> bool:
            latest.append(await self.read())
            return latest[-1][1] > self.queries

        for _ in range(100):
            if await counted():
                break
            await asyncio.sleep(0.1)  # vLLM logs its stats each step
        assert latest and latest[-1][1] > self.queries, "vLLM never counted the prompt"
        return latest[-1][0] - self.hits


async def test_tenants_share_no_prefix_cache_unless_grouped(engine: EngineProcess) -> None:
    config = make_config([{"url": engine.spec.url, "max_inflight": 2}])
    for tenant in config["tenants"]:
        if tenant["name"] != "tenant-high":
            tenant["cache_group"] = "team"
    async with (
        running_proxy(config) as (base, _),
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
    ):
        counters = Counters(session, engine.spec.url)

        def send(tier: str, prompt: str, **extra: Any) -> Any:
            async def go() -> None:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, **extra}
                async with session.post(
                    f"{base}/v1/completions", json=body, headers=auth(tier)
                ) as resp:
                    assert resp.status == 200, await resp.text()

            return go

        secret_of_a = _prompt()
        assert await counters.hit_by(send("high", secret_of_a)) == 0
        # B, even naming A's salt (as if it had learned it), gets no hit on A's prompt.
        a_salt = derive_cache_salt(SECRET, "tenant:tenant-high")
        assert await counters.hit_by(send("normal", secret_of_a, cache_salt=a_salt)) == 0
        # A repeating its prompt does hit.
        assert await counters.hit_by(send("high", secret_of_a)) > 0
        # Two tenants of one cache_group share.
        shared = _prompt()
        assert await counters.hit_by(send("low", shared)) == 0
        assert await counters.hit_by(send("normal", shared)) > 0
