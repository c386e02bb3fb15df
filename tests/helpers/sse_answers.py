"""Hand-written event streams a fake backend answers with (the relay fault tests)."""

from __future__ import annotations

import orjson
from aiohttp import web


def chunk(text: str) -> bytes:
    delta = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return b"data: " + orjson.dumps({"object": "chat.completion.chunk", **delta}) + b"\n\n"


async def sse_answer(request: web.Request, *parts: bytes) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for part in parts:
        await resp.write(part)
    await resp.write_eof()
    return resp
