"""Tokenizer routes (/tokenize, /detokenize) against a better tier's generation, in process:
they never take the backends' generation room (issue 22: six low-tier /tokenize calls held a
backend's six slots and a high-tier chat got 503 at its queue timeout), and they have a small
cap of their own per backend. The served twin: tests/adversarial/served/test_memory_routes_startup_served.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import SECRET, auth, make_config, until
from proxy.config.loader import parse_config
from proxy.server.app import create_app
from proxy.server.state import STATE, ProxyState
from tests.helpers.clock import FakeClock

Client = TestClient[web.Request, web.Application]
TOKENIZE = {"model": "tiny", "prompt": "hello"}
DETOKENIZE = {"model": "tiny", "tokens": [1, 2]}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}


@contextlib.asynccontextmanager
async def proxy(
    clock: FakeClock, backend: FakeVLLM, **backend_cfg: Any
) -> AsyncIterator[tuple[Client, ProxyState]]:
    async with backend.serve() as url:
        config = make_config(
            [{"url": url, "max_inflight": 4, **backend_cfg}],
            tiers={"high": {"queue_timeout_s": 3}},
        )
        app = create_app(parse_config(yaml.safe_dump(config)), secret=SECRET, clock=clock)
        async with TestClient(TestServer(app)) as client:
            yield client, app[STATE]


async def test_low_tier_tokenize_calls_never_delay_a_high_tier_chat(clock: FakeClock) -> None:
    backend = FakeVLLM(tokenize_gate=asyncio.Event())
    async with proxy(clock, backend) as (client, state):  # 4 slots; 4 tokenizer calls (default)
        calls = [
            asyncio.create_task(client.post("/tokenize", json=TOKENIZE, headers=auth(tier)))
            for tier in ("low", "low", "normal", "normal")
        ]
        try:
            await until(lambda: backend.tokenizing == 4, 5, "four tokenizer calls at the backend")
            async with asyncio.timeout(30):  # against hanging
                resp = await client.post("/v1/chat/completions", json=CHAT, headers=auth("high"))
            assert resp.status == 200, await resp.text()
            assert state.pool.all()[0].inflight == 0  # the chat's slot is back; none taken
        finally:
            assert backend.tokenize_gate is not None
            backend.tokenize_gate.set()
            for resp in await asyncio.gather(*calls):
                assert resp.status == 200
                resp.release()


async def test_tokenizer_calls_past_their_cap_get_503_with_retry_after(clock: FakeClock) -> None:
    backend = FakeVLLM(tokenize_gate=asyncio.Event())
    async with proxy(clock, backend, max_cheap_inflight=2) as (client, state):
        calls = [
            asyncio.create_task(client.post("/tokenize", json=TOKENIZE, headers=auth(tier)))
            for tier in ("low", "normal")
        ]
        try:
            await until(lambda: backend.tokenizing == 2, 5, "two tokenizer calls at the backend")
            async with client.post("/detokenize", json=DETOKENIZE, headers=auth("high")) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["code"] == "backend_busy"
        finally:
            assert backend.tokenize_gate is not None
            backend.tokenize_gate.set()
            for resp in await asyncio.gather(*calls):
                resp.release()
        assert state.pool.all()[0].cheap_inflight == 0
        async with client.post("/tokenize", json=TOKENIZE, headers=auth("low")) as resp:
            assert resp.status == 200


async def test_one_tenant_takes_at_most_half_the_tokenizer_slots(clock: FakeClock) -> None:
    # Finding #22: one tenant's four slow /tokenize calls made every other tenant's a 503.
    backend = FakeVLLM(tokenize_gate=asyncio.Event())
    async with proxy(clock, backend) as (client, state):  # 4 tokenizer slots (the default)
        hogs = [
            asyncio.create_task(client.post("/tokenize", json=TOKENIZE, headers=auth("low")))
            for _ in range(2)
        ]
        try:
            await until(lambda: backend.tokenizing == 2, 5, "the tenant's two calls")
            async with client.post("/tokenize", json=TOKENIZE, headers=auth("low")) as resp:
                assert resp.status == 503  # its share (half of 4) is taken
                assert (await resp.json())["error"]["code"] == "backend_busy"
            others = [
                asyncio.create_task(client.post("/tokenize", json=TOKENIZE, headers=auth(tier)))
                for tier in ("high", "normal")
            ]
            await until(lambda: backend.tokenizing == 4, 5, "the other tenants' calls")
            held = {"tenant-low": 2, "tenant-high": 1, "tenant-normal": 1}
            assert state.pool.all()[0].cheap_by_tenant.held == held
        finally:
            assert backend.tokenize_gate is not None
            backend.tokenize_gate.set()
        for resp in await asyncio.gather(*hogs, *others):
            assert resp.status == 200
            resp.release()
        assert state.pool.all()[0].cheap_by_tenant.held == {}
