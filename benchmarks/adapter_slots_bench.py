"""The two ways one tier or tenant could take an engine's adapter slots from the others, the
proxy in process against a fake engine with `max_loras: 2` whose decode takes a set time per
token (docs/adapters.md, "Slots among tiers and tenants"):

1. a 2-token high-tier request for a third adapter sent while a low-tier tenant runs two
   250-token generations on two adapters: how long it took, as a share of one low generation;
2. a tenant cycling three shared adapters with 1-token requests, another tenant's adapter
   asked for after each cycle: how many of that tenant's requests had to load it again.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/adapter_slots_bench.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import aiohttp
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import auth, make_config, running_proxy, serve_app


def _engine(per_token_s: float, loads: list[str]) -> web.Application:
    async def load(request: web.Request) -> web.Response:
        loads.append((await request.json())["lora_name"])
        return web.Response(text="Success")

    async def unload(request: web.Request) -> web.Response:
        return web.Response(text="Success")

    app = FakeVLLM(delay_per_token_s=per_token_s).app()
    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)
    return app


def _config(url: str) -> dict[str, Any]:
    adapters: dict[str, dict[str, Any]] = {
        name: {"path": f"/adapters/{name}", "base_model": "tiny", "tenants": [tenant]}
        for name, tenant in (
            ("low-1", "tenant-low"),
            ("low-2", "tenant-low"),
            ("high-1", "tenant-high"),
            ("theirs", "tenant-low"),
        )
    }
    for name in ("s1", "s2", "s3"):
        adapters[name] = {"path": f"/adapters/{name}", "base_model": "tiny", "shared": True}
    backend = {"url": url, "max_inflight": 8, "max_loras": 2, "load_adapters": True}
    # The fake lists no adapter: a /v1/models probe would drop the proxy's count of its loads.
    return make_config([backend], adapters=adapters, backend_health={"models_interval_s": 3600})


async def _timed(
    client: aiohttp.ClientSession, base: str, tier: str, model: str, max_tokens: int
) -> float:
    started = time.monotonic()
    body = {"model": model, "prompt": "hi", "max_tokens": max_tokens}
    async with client.post(f"{base}/v1/completions", json=body, headers=auth(tier)) as resp:
        await resp.read()
        assert resp.status == 200, resp.status
    return time.monotonic() - started


async def main(per_token_s: float) -> dict[str, Any]:
    loads: list[str] = []
    async with (
        serve_app(_engine(per_token_s, loads), handler_cancellation=True) as url,
        running_proxy(_config(url)) as (base, _),
        aiohttp.ClientSession() as client,
    ):
        lows = [
            asyncio.create_task(_timed(client, base, "low", name, 250))
            for name in ("low-1", "low-2")
        ]
        await asyncio.sleep(20 * per_token_s)
        high = await _timed(client, base, "high", "high-1", 2)
        low = await asyncio.gather(*lows)
        loads.clear()
        for _ in range(10):
            for name in ("s1", "s2", "s3"):
                await _timed(client, base, "normal", name, 1)
            await _timed(client, base, "low", "theirs", 1)
    return {
        "high_s": round(high, 3),
        "low_s": [round(s, 3) for s in low],
        "high_over_one_low_generation": round(high / min(low), 3),
        "theirs_loads_of_10": loads.count("theirs"),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-token-s", type=float, default=0.01, help="the fake's decode")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.per_token_s))))
