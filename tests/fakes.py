"""In-process fake backends for what real vLLM cannot show on demand: a backend that hangs,
one that dies mid-stream, one that refuses or is overloaded. Never used in place of vLLM for
anything real vLLM can show."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from proxy.engine import free_port


def _hung_app() -> web.Application:
    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(3600)  # accepts, reads nothing back, never answers
        return web.Response()

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hang)
    return app


def _dies_mid_stream_app(events_before_death: int) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(events_before_death):
            chunk = ('data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
                     f'"delta":{{"content":"t{i}"}},"finish_reason":null}}]}}\n\n')
            await resp.write(chunk.encode())
            await asyncio.sleep(0.01)
        assert request.transport is not None
        request.transport.abort()  # the connection drops without [DONE]
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    return app


@contextlib.asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def hung_backend() -> contextlib.AbstractAsyncContextManager[str]:
    return serve_app(_hung_app())


def dies_mid_stream_backend(events: int = 3) -> contextlib.AbstractAsyncContextManager[str]:
    return serve_app(_dies_mid_stream_app(events))
