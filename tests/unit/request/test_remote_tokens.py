"""The prompt's tokens from a backend's /tokenize (proxy.request.remote_tokens), against an
in-process backend: what is asked, the answer used, and the bounds (calls in flight, timeout,
a refused or odd answer) that give no tokens rather than a wait or a guess."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from proxy.backends.pool import BackendPool
from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import serve_app
from proxy.config.backends import Backend, BackendHealth
from proxy.config.kv_cache import KvCache
from proxy.policies.backends import LeastUtilised
from proxy.request.inbound import ParsedRequest
from proxy.request.remote_tokens import RemoteTokenizer, tokenize_body
from tests.helpers.clock import FakeClock
from tests.helpers.rig import served_rig, tenants


def parsed(body: dict[str, Any], endpoint: str = "chat") -> ParsedRequest:
    return ParsedRequest(body, endpoint, False, "tiny", 10, 16, 16, False)  # type: ignore[arg-type]


def test_the_tokenize_request_carries_what_changes_the_tokens() -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "tools": [{"type": "function"}], "temperature": 0.5}
    assert tokenize_body(parsed(body)) == {
        "messages": messages,
        "tools": [{"type": "function"}],
        "model": "tiny",
    }
    assert tokenize_body(parsed({"prompt": ["abc"]}, "completions")) == {
        "prompt": "abc",
        "model": "tiny",
    }
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]
    for refused in (
        parsed({"messages": image}),
        parsed({"messages": messages, "documents": []}),
        parsed({"prompt": ["a", "b"]}, "completions"),
        parsed({"prompt": [1, 2]}, "completions"),  # token ids need no tokenizer at all
        parsed({"input": "x"}, "responses"),
    ):
        assert tokenize_body(refused) is None


class Backend1:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.answer: Any = {"count": 3, "tokens": [5, 6, 7], "max_model_len": 2048}
        self.status = 200
        self.gate = asyncio.Event()
        self.gate.set()

    async def tokenize(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        await self.gate.wait()
        return web.json_response(self.answer, status=self.status)


@asynccontextmanager
async def _tokenizing(fake: Backend1) -> AsyncIterator[tuple[BackendPool, aiohttp.ClientSession]]:
    """A pool of one backend whose /tokenize is ``fake``'s, and a session to reach it."""
    app = web.Application()
    app.router.add_post("/tokenize", fake.tokenize)
    async with serve_app(app) as url, aiohttp.ClientSession() as session:
        yield BackendPool([Backend(url=url)], BackendHealth(), LeastUtilised()), session


HI = parsed({"messages": [{"role": "user", "content": "hi"}]})


async def test_tokens_from_the_backend_within_bounds() -> None:
    fake = Backend1()
    remote, request = RemoteTokenizer(), HI
    async with _tokenizing(fake) as (pool, session):
        kv = KvCache(tokenize_timeout_s=5.0, max_remote_tokenize=1)
        assert await remote.tokens(request, kv, pool, session, 0.0) == [5, 6, 7]
        assert fake.bodies[-1]["messages"] == [{"role": "user", "content": "hi"}]
        # One call in flight at most: the next gets nothing at once.
        fake.gate.clear()
        held = asyncio.create_task(remote.tokens(request, kv, pool, session, 0.0))
        while remote.inflight == 0:
            await asyncio.sleep(0)
        assert await remote.tokens(request, kv, pool, session, 0.0) is None
        fake.gate.set()
        assert await held == [5, 6, 7] and remote.inflight == 0
        # Refused (a ticket required, say), odd answers, a backend too slow: nothing.
        fake.status = 403
        assert await remote.tokens(request, kv, pool, session, 0.0) is None
        fake.status = 200
        # Ids no tokenizer gives (past 64 bits they failed the hashing: a 500 to the client).
        for odd in ({"tokens": ["a"]}, [1, 2], {"count": 1}, {"tokens": [2**63]}, {"tokens": [-1]}):
            fake.answer = odd
            assert await remote.tokens(request, kv, pool, session, 0.0) is None
        fake.answer, fake.gate = {"tokens": [1]}, asyncio.Event()
        quick = KvCache(tokenize_timeout_s=0.05)
        assert await remote.tokens(request, quick, pool, session, 0.0) is None
        fake.gate.set()
        # No backend available (ejected): nothing asked.
        pool.all()[0].healthy = False
        calls = len(fake.bodies)
        assert await remote.tokens(request, kv, pool, session, 0.0) is None
        assert len(fake.bodies) == calls


async def test_the_pipeline_tokenizes_only_requests_that_may_run(clock: FakeClock) -> None:
    """Through a backend's /tokenize (no local tokenizer): a request the tenant's limits refuse
    costs the backends no /tokenize call; one that runs asks it once, before being queued."""
    backend = FakeVLLM()
    async with served_rig(
        clock,
        backend,
        tenants=tenants(requests_per_minute=1),
        kv_cache={"enabled": True, "block_size": 1},
    ) as r:
        assert (await r.chat()).status == 200
        assert [x.path for x in backend.received] == ["/tokenize", "/v1/chat/completions"]
        assert (await r.chat()).status == 429
        assert len(backend.received) == 2
    # kv_cache off (the default): never asked.
    backend = FakeVLLM()
    async with served_rig(clock, backend) as r:
        assert (await r.chat()).status == 200
        assert [x.path for x in backend.received] == ["/v1/chat/completions"]


async def test_one_tenant_holds_at_most_half_of_the_calls_in_flight() -> None:
    # A tenant's burst of long prompts held every call; the others' requests got no blocks
    # and left their caches (tests/integration/test_kv_placement_served.py).
    fake = Backend1()
    fake.gate.clear()
    remote, request = RemoteTokenizer(), HI
    async with _tokenizing(fake) as (pool, session):
        kv = KvCache(tokenize_timeout_s=5.0, max_remote_tokenize=4)
        held = [
            asyncio.create_task(remote.tokens(request, kv, pool, session, 0.0, "flood"))
            for _ in range(2)
        ]
        while remote.inflight < 2:
            await asyncio.sleep(0)
        assert await remote.tokens(request, kv, pool, session, 0.0, "flood") is None
        other = asyncio.create_task(remote.tokens(request, kv, pool, session, 0.0, "calm"))
        while remote.inflight < 3:
            await asyncio.sleep(0)
        fake.gate.set()
        assert await other == [5, 6, 7]
        assert [await h for h in held] == [[5, 6, 7]] * 2
        assert remote.inflight == 0 and not remote.by_tenant.held
