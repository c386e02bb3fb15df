"""Quota and budget used per tenant in ``/admin/status`` and on ``tierproxy top``'s screen."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import yaml
from aiohttp.test_utils import TestClient, TestServer
from rich.console import Console

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import SECRET, auth, make_config, until
from proxy.config.loader import parse_config
from proxy.config.tenants import hash_key
from proxy.ops.live.top import render
from proxy.server.app import create_app
from proxy.server.state import STATE
from tests.helpers.clock import FakeClock

ADMIN = {"Authorization": "Bearer admin-secret"}
PRICING = {"tiny": {"input": 1_000_000, "output": 2_000_000}}  # 1 and 2 per token
QUOTA = {"tokens_per_day": 1000, "budget_per_month": 200}


async def test_status_shows_each_tenants_quota_used(clock: FakeClock) -> None:
    backend = FakeVLLM(usage=(7, 3))
    async with backend.serve() as url:
        tenants = [
            {"name": "acme", "tier": "normal", "keys": [{"sha256": hash_key("key-normal")}]},
            {"name": "free", "tier": "high", "keys": [{"sha256": hash_key("key-high")}]},
        ]
        config = make_config(
            [{"url": url}],
            tiers={"normal": {"quota": QUOTA}},
            tenants=tenants,
            pricing=PRICING,
            admin_keys=[{"sha256": hash_key("admin-secret")}],
        )
        app = create_app(parse_config(yaml.safe_dump(config)), secret=SECRET, clock=clock)
        state = app[STATE]
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with TestClient(TestServer(app)) as client:
            await until(lambda: bool(state.pool.known_models()), 10, "the backend's models")
            for tier in ("normal", "normal", "high"):
                async with client.post("/v1/chat/completions", json=body, headers=auth(tier)) as r:
                    assert r.status == 200
            async with asyncio.timeout(10), client.get("/admin/status", headers=ADMIN) as r:
                status = await r.json()
    rows = {t["name"]: t for t in status["tenants"]}
    quota = rows["acme"]["quota"]
    assert set(quota) == {"tokens_per_day", "budget_per_month"}
    assert quota["tokens_per_day"]["used"] == 20 and quota["tokens_per_day"]["limit"] == 1000
    assert quota["budget_per_month"]["used"] == 26  # 2 x (7 x 1 + 3 x 2)
    assert 0 < quota["tokens_per_day"]["resets_in_s"] <= 86400
    assert len(quota["budget_per_month"]["period"]) == 7  # "YYYY-MM"
    assert rows["free"]["quota"] == {}
    screen = _text(render(status, "http://proxy"))
    line = next(x for x in screen.splitlines() if "│ acme" in x)
    assert "tok/d 2%" in line and "$/mo 13%" in line


def _text(renderable: Any) -> str:
    console = Console(width=220, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()
