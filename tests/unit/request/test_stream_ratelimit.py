"""x-ratelimit-* on streams of every route (issue #25 item 5), in-process through the app as it
is served: the windows as they stood when the request was admitted, sent with the stream's
headers. The served twin: tests/replicas/test_stream_ratelimit_served.py."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import auth, make_config, running_proxy
from tests.helpers.rig import tenants

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
ROUTES = [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 8}),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 8}),
]


@pytest.mark.parametrize(("path", "body"), ROUTES, ids=["chat", "completions", "responses"])
async def test_streams_carry_the_windows_of_their_admission(
    path: str, body: dict[str, Any]
) -> None:
    backend = FakeVLLM()
    async with backend.serve() as url:
        people = tenants(requests_per_minute=6, tokens_per_minute=50_000)  # 10 s a request
        config = make_config([{"url": url}], tenants=people)
        async with running_proxy(config) as (base, _), aiohttp.ClientSession() as session:
            for n in (1, 2):
                async with session.post(
                    base + path, json={**body, "stream": True}, headers=auth("normal")
                ) as resp:
                    assert resp.status == 200
                    assert resp.headers["Content-Type"].startswith("text/event-stream")
                    h = resp.headers
                    assert h["x-ratelimit-limit-requests"] == "6"
                    assert h["x-ratelimit-remaining-requests"] == str(6 - n)
                    assert h["x-ratelimit-reset-requests"].endswith("s")
                    assert h["x-ratelimit-limit-tokens"] == "50000"
                    assert 50_000 - 100 * n < int(h["x-ratelimit-remaining-tokens"]) < 50_000
                    await resp.read()


async def test_a_tenant_without_limits_gets_none() -> None:
    backend = FakeVLLM()
    async with backend.serve() as url:
        config = make_config([{"url": url}])
        async with (
            running_proxy(config) as (base, _),
            aiohttp.ClientSession() as session,
            session.post(
                base + "/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth("normal")
            ) as resp,
        ):
            await resp.read()
            assert resp.status == 200
            assert not [h for h in resp.headers if h.lower().startswith("x-ratelimit")]
