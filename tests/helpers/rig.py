"""The pipeline rig: the request pipeline over a ProxyState's parts, served by a bare app, with
the fake clock driving the queue deadlines, the ejections and the tenant-limit waits. ``served_rig``
serves fake vLLM backends and builds the rig over them in one step."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.api.routes import BY_ENDPOINT
from proxy.backends.backend import BackendState
from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import SECRET, auth, make_config
from proxy.config.loader import parse_config
from proxy.config.tenants import hash_key
from proxy.policies.tenants import VirtualTokenCounter
from proxy.server.state import ProxyState
from tests.helpers.clock import FakeClock

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}


class ClockSleep:
    """The tenant-limit wait on the fake clock: a sleep moves the clock on by its length.
    While ``gate`` is cleared, sleeps wait there first (a client can leave meanwhile)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.waits: list[float] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        await self.gate.wait()
        self.clock.advance(seconds)


@dataclass
class Rig:
    state: ProxyState
    client: TestClient[web.Request, web.Application]
    clock: FakeClock
    sleep: ClockSleep
    config: dict[str, Any] = field(default_factory=dict)
    urls: list[str] = field(default_factory=list)  # of the backends ``served_rig`` serves

    async def chat(self, tier: str = "normal", **extra: Any) -> aiohttp.ClientResponse:
        resp = await self.client.post(
            "/v1/chat/completions", json={**BODY, **extra}, headers=auth(tier)
        )
        await resp.read()
        return resp

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.state.metrics.registry.get_sample_value(name, labels or {})
        return value or 0.0

    def requests_total(self, outcome: str, tier: str = "normal") -> float:
        return self.metric("tierproxy_requests_total", {"tier": tier, "outcome": outcome})

    def backend(self) -> BackendState:
        """The one backend of a one-backend rig."""
        (state,) = self.state.pool.all()
        return state

    def vtc_counter(self, tenant: str) -> float:
        fairness = self.state.queue.fairness
        assert isinstance(fairness, VirtualTokenCounter)
        return fairness.counter(tenant)

    def reload(self, config: dict[str, Any]) -> None:
        self.state.apply(parse_config(yaml.safe_dump(config), "reloaded"))

    async def advance(self, seconds: float) -> None:
        """Move the clock on and let the dispatcher act on it (deadlines, ejections)."""
        self.clock.advance(seconds)
        self.state.dispatcher.kick()
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def rig(config: dict[str, Any], clock: FakeClock) -> AsyncIterator[Rig]:
    """The pipeline over a ProxyState's parts, served by a bare app (no monitor: backends stay
    as the test leaves them)."""
    state = ProxyState(parse_config(yaml.safe_dump(config), "test"), SECRET, clock)
    sleep = ClockSleep(clock)
    async with aiohttp.ClientSession() as session:
        # The pipeline as the app wires it; only its upstream session and its sleep are the
        # test's (the app's lifecycle, which makes the session, does not run here).
        state.session = session
        pipeline = state.pipeline
        pipeline.sleep = sleep
        app = web.Application()
        app.router.add_post("/v1/chat/completions", pipeline.handler(BY_ENDPOINT["chat"]))
        state.dispatcher.start()
        try:
            async with TestClient(TestServer(app)) as client:
                yield Rig(state, client, clock, sleep, config)
        finally:
            await state.dispatcher.stop()


@contextlib.asynccontextmanager
async def served_rig(
    clock: FakeClock,
    *backends: FakeVLLM,
    backend: dict[str, Any] | None = None,
    **config: Any,
) -> AsyncIterator[Rig]:
    """Serve ``backends`` (one default ``FakeVLLM`` when none) and yield the rig over them;
    ``backend``: settings of every backend entry (e.g. ``max_inflight``), ``config``:
    ``make_config``'s keywords. The rig's ``config`` and ``urls`` say what was built."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(b.serve()) for b in backends or (FakeVLLM(),)]
        built = make_config([{"url": url, **(backend or {})} for url in urls], **config)
        r = await stack.enter_async_context(rig(built, clock))
        r.urls = urls
        yield r


def tenant(name: str, tier: str, key: str, **limits: Any) -> dict[str, Any]:
    return {"name": name, "tier": tier, "keys": [{"sha256": hash_key(key)}], **limits}


def tenants(**normal_limits: Any) -> list[dict[str, Any]]:
    """The usual three tenants; ``tenant-normal`` gets ``normal_limits``."""
    return [
        tenant("tenant-high", "high", "key-high"),
        tenant("tenant-normal", "normal", "key-normal", **normal_limits),
        tenant("tenant-low", "low", "key-low"),
    ]


def relay_config(url: str, **relay: Any) -> dict[str, Any]:
    """One backend at ``url``, the relay section set to ``relay``."""
    return make_config([{"url": url}], relay=relay)


async def error_of(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    """The OpenAI-shaped error of ``resp``, checked for its four fields."""
    body = await resp.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


async def stream_body(resp: aiohttp.ClientResponse) -> list[bytes]:
    return [e for e in (await resp.read()).split(b"\n\n") if e]
