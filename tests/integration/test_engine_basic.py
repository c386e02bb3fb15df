"""The real engine answers chat and completion requests, streaming and not, with correct
shapes and token counts (what every other integration test stands on)."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from proxy.relay import sse
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import CORE

pytestmark = [pytest.mark.integration, pytest.mark.engines(CORE)]
TIMEOUT = aiohttp.ClientTimeout(total=60)


async def _sse(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    return [orjson.loads(data) async for data in sse.data_of(resp) if data != sse.DONE]


async def test_chat_and_completions_shapes_and_counts(engines: EngineFarm) -> None:
    url = engines.get(CORE).spec.url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 7,
            "ignore_eos": True,
        }
        async with s.post(f"{url}/v1/chat/completions", json=chat) as r:
            assert r.status == 200
            body = await r.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] == 7
        assert body["choices"][0]["finish_reason"] == "length"

        comp = {"model": "tiny", "prompt": "count to ten", "max_tokens": 5, "ignore_eos": True}
        async with s.post(f"{url}/v1/completions", json=comp) as r:
            body = await r.json()
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 5

        stream = {**comp, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(f"{url}/v1/completions", json=stream) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = await _sse(r)
        assert events[-1]["usage"]["completion_tokens"] == 5
        assert sum(1 for e in events if e["choices"]) >= 5

        async with s.post(f"{url}/v1/chat/completions", json={**chat, "stream": True}) as r:
            events = await _sse(r)
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        assert events[-1]["choices"][0]["finish_reason"] == "length"
