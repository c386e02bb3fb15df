"""The real engine answers chat and completion requests, streaming and not, with correct
shapes and token counts (what every other integration test stands on)."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

pytestmark = pytest.mark.integration
TIMEOUT = aiohttp.ClientTimeout(total=60)


async def _sse(resp: aiohttp.ClientResponse) -> list[dict[str, object]]:
    events = []
    async for line in resp.content:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            events.append(orjson.loads(line[6:]))
    return events


async def test_chat_and_completions_shapes_and_counts(engines) -> None:  # type: ignore[no-untyped-def]
    url = engines.get("core").spec.url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 7, "ignore_eos": True}
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
        assert events[-1]["usage"]["completion_tokens"] == 5  # type: ignore[index]
        assert sum(1 for e in events if e["choices"]) >= 5

        async with s.post(f"{url}/v1/chat/completions", json={**chat, "stream": True}) as r:
            events = await _sse(r)
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
