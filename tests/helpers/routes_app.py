"""The whole app in front of an in-process fake vLLM, and a body for every POST route: the
route tests (tests/unit/server/test_routes.py) and the stored-responses tests share them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import SECRET, make_config
from proxy.config.loader import parse_config
from proxy.config.tenants import hash_key
from proxy.server.app import create_app
from proxy.server.state import STATE, ProxyState
from tests.helpers.clock import FakeClock

Client = TestClient[web.Request, web.Application]

LIMITED_KEY = "key-limited"
BODIES: dict[str, dict[str, Any]] = {
    "/v1/responses": {"model": "tiny", "input": "hello", "max_output_tokens": 4},
    "/v1/embeddings": {"model": "tiny", "input": ["hello", "world"]},
    "/pooling": {"model": "tiny", "input": "hello"},
    "/classify": {"model": "tiny", "input": "hello"},
    "/score": {"model": "tiny", "text_1": "q", "text_2": ["a", "b"]},
    "/v1/score": {"model": "tiny", "queries": "q", "documents": ["a"]},
    "/rerank": {"model": "tiny", "query": "q", "documents": ["a", "b"]},
    "/v1/rerank": {"model": "tiny", "query": "q", "documents": ["a"]},
    "/v2/rerank": {"model": "tiny", "query": "q", "documents": ["a"]},
    "/tokenize": {"model": "tiny", "prompt": "hello"},
    "/detokenize": {"model": "tiny", "tokens": [1, 2]},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
    "/v1/completions": {"model": "tiny", "prompt": "x"},
}


@contextlib.asynccontextmanager
async def proxy(clock: FakeClock, backend: FakeVLLM) -> AsyncIterator[tuple[Client, ProxyState]]:
    async with backend.serve() as url:
        limited = {
            "name": "limited",
            "tier": "normal",
            "keys": [{"sha256": hash_key(LIMITED_KEY)}],
            "requests_per_minute": 60,
            "tokens_per_minute": 6000,
        }
        high = {"name": "tenant-high", "tier": "high", "keys": [{"sha256": hash_key("key-high")}]}
        config = make_config([{"url": url}], tenants=[high, limited])
        app = create_app(parse_config(yaml.safe_dump(config)), secret=SECRET, clock=clock)
        async with TestClient(TestServer(app)) as client:
            yield client, app[STATE]
