"""A reload and the requests that wait in the proxy's queue, against `tierproxy serve` (a
subprocess on its default loop) in front of the suite's real CPU vLLM (red team F3 of rt4,
redteam/p07_reload_queued.py). The backend's room is 1 and each request asks for long outputs
(``ignore_eos``): the first runs, the others wait in the queue, no sleep needed. What is checked
is counted (statuses, error codes, the usage log, /admin/status), never timed. The in-process
twin, on the fake clock: tests/unit/request/test_reload_waiting.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.bench.hostile.served import ADMIN_KEY, ServedProxy, admin_sections
from proxy.bench.inproc import KEYS, make_config
from proxy.tools.engine import EngineProcess
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import CORE
from tests.helpers.rig import tenant
from tests.helpers.served_logs import sighup_reload, usage_records, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.engines(CORE)]
TIMEOUT = aiohttp.ClientTimeout(total=300)
TENANT = "tenant-normal"
BIG = 100_000  # the quota the requests are admitted under
OUTPUT = 1900  # each request's output: ~2.4 s of the tiny model on an idle core (4+ beside the
# suite), the first's hold of the backend: the reload takes a fraction of it
SHORT = 200  # the queued requests' output where they are served after the reload
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": OUTPUT,
        "ignore_eos": True}  # fmt: skip


@pytest.fixture(scope="module")
def engine(engines: EngineFarm) -> EngineProcess:
    return engines.get(CORE)


def config(engine: EngineProcess, tmp: Path, quota: float, **normal: Any) -> dict[str, Any]:
    tenants = [
        tenant("tenant-high", "high", KEYS["high"]),
        {**tenant(TENANT, "normal", KEYS["normal"], quota={"tokens_per_day": quota}), **normal},
    ]
    return make_config(
        [{"url": engine.spec.url, "max_inflight": 1}],
        tenants=tenants,
        usage_log={"path": str(tmp / "usage.jsonl")},
        **admin_sections(),
    )


class Client:
    def __init__(self, session: aiohttp.ClientSession, proxy: ServedProxy) -> None:
        self.session, self.proxy = session, proxy

    async def chat(self, max_tokens: int = OUTPUT) -> tuple[int, dict[str, Any]]:
        url, headers = f"{self.proxy.url}/v1/chat/completions", auth()
        body = {**BODY, "max_tokens": max_tokens}
        async with self.session.post(url, json=body, headers=headers) as resp:
            return resp.status, await resp.json()

    async def row(self) -> dict[str, Any]:
        """The tenant's row of /admin/status (queued, running, quota)."""
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with self.session.get(f"{self.proxy.admin_url}/admin/status", headers=headers) as r:
            rows = {t["name"]: t for t in (await r.json())["tenants"]}
        row: dict[str, Any] = rows.get(TENANT, {"queued": 0, "running": 0})
        return row

    async def until_queued(self, n: int = 0) -> None:
        deadline = time.monotonic() + 60
        while (row := await self.row())["queued"] < n or row["running"] < 1:
            assert time.monotonic() < deadline, row
            await asyncio.sleep(0.1)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS['normal']}"}


@asynccontextmanager
async def served(config: dict[str, Any], tmp: Path) -> AsyncIterator[Client]:
    proxy = ServedProxy(config, tmp)
    await asyncio.to_thread(proxy.start)
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            yield Client(session, proxy)
    finally:
        await asyncio.to_thread(proxy.stop)


async def test_a_revoked_keys_queued_requests_get_401_right_after_the_reload(
    engine: EngineProcess, tmp_path: Path
) -> None:
    cfg = config(engine, tmp_path, BIG)
    async with served(cfg, tmp_path) as client:
        tasks = [asyncio.create_task(client.chat()) for _ in range(4)]
        await client.until_queued(3)
        revoked = config(engine, tmp_path, BIG, keys=[{"sha256": "0" * 64}])
        await sighup_reload(client.proxy, revoked)
        # Out of the queue by the reload itself (logged once applied), the one running left.
        row = await client.row()
        assert (row["queued"], row["running"]) == (0, 1), row
        # Answered while it runs (it has 1,900 tokens to make): the 401 a new request gets.
        await wait_for(lambda: sum(t.done() for t in tasks) >= 3, 30, "the queued answered")
        refused = [t.result() for t in tasks if t.done() and t.result()[0] == 401]
        assert len(refused) == 3, [t.result()[0] for t in tasks if t.done()]
        assert {r[1]["error"]["code"] for r in refused} == {"invalid_api_key"}
        assert (await client.chat())[0] == 401
        statuses = sorted([s for s, _ in await asyncio.gather(*tasks)])
        assert statuses == [200, 401, 401, 401]  # the running one is left to finish
        log = tmp_path / "usage.jsonl"
        # The four admitted (the new request's 401 came before its tenant was known): the
        # queued ones billed nothing.
        await wait_for(lambda: len(usage_records(log)) == 4, 10, "the usage-log lines")
        records = usage_records(log)
        assert sorted(r["status"] for r in records) == [200, 401, 401, 401]
        assert [r["completion_tokens"] for r in records if r["status"] == 401] == [0, 0, 0]
        assert [r["completion_tokens"] for r in records if r["status"] == 200] == [OUTPUT]


async def test_a_lowered_quota_refuses_the_queued_excess_with_429(
    engine: EngineProcess, tmp_path: Path
) -> None:
    cfg = config(engine, tmp_path, BIG)
    async with served(cfg, tmp_path) as client:
        tasks = [asyncio.create_task(client.chat())]  # it holds the backend
        await client.until_queued()
        tasks += [asyncio.create_task(client.chat(SHORT)) for _ in range(4)]
        await client.until_queued(4)
        # Room for the running one and the earliest queued (each reserved its output and its
        # prompt's upper bound, read off the counter), and half of a third.
        used = (await client.row())["quota"]["tokens_per_day"]["used"]
        bound = (used - OUTPUT - 4 * SHORT) // 5  # the prompt's upper bound
        limit = int(OUTPUT + SHORT + 2 * bound + (SHORT + bound) // 2)
        await sighup_reload(client.proxy, config(engine, tmp_path, limit))
        row = await client.row()
        assert (row["queued"], row["running"]) == (1, 1), row
        await wait_for(lambda: sum(t.done() for t in tasks) >= 3, 30, "the excess answered")
        refused = [t.result() for t in tasks if t.done()]
        assert [s for s, _ in refused] == [429] * 3
        assert {r[1]["error"]["code"] for r in refused} == {"quota_exceeded"}
        assert all(f"limit {limit}" in r[1]["error"]["message"] for r in refused)
        statuses = sorted([s for s, _ in await asyncio.gather(*tasks)])
        assert statuses == [200, 200, 429, 429, 429]
        log = tmp_path / "usage.jsonl"
        await wait_for(lambda: len(usage_records(log)) == 5, 10, "the usage-log lines")
        billed = sum(r["prompt_tokens"] + r["completion_tokens"] for r in usage_records(log))
        used = (await client.row())["quota"]["tokens_per_day"]["used"]
        assert used == billed <= limit  # the counter: the two served, nothing of the refused
        assert (await client.chat())[0] == 429  # as a new request
