"""In-process fake backends for what real vLLM cannot show on demand: a backend that hangs,
one that dies mid-stream, one that refuses or is overloaded. Never used in place of vLLM for
anything real vLLM can show."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from proxy.bench.inproc import serve_app


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
            chunk = (
                'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
                f'"delta":{{"content":"t{i}"}},"finish_reason":null}}]}}\n\n'
            )
            await resp.write(chunk.encode())
            await asyncio.sleep(0.01)
        assert request.transport is not None
        request.transport.abort()  # the connection drops without [DONE]
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def hung_backend() -> contextlib.AbstractAsyncContextManager[str]:
    return serve_app(_hung_app())


def dies_mid_stream_backend(events: int = 3) -> contextlib.AbstractAsyncContextManager[str]:
    return serve_app(_dies_mid_stream_app(events))


class ScriptedBackend:
    """An OpenAI-compatible backend whose answers a test sets: ``status`` (200, or an error
    such as vLLM's 503), the ``usage`` it reports, and ``gate`` (while cleared, requests wait
    at the backend, before any byte of the answer). It counts what it received and how many
    callers hung up on it. Serve it with ``serve_scripted`` (cancels handlers on hang-up)."""

    def __init__(self, *, status: int = 200, usage: tuple[int, int] = (7, 3)) -> None:
        self.status = status
        self.usage = usage
        self.gate = asyncio.Event()
        self.gate.set()
        self.received: list[dict[str, object]] = []
        self.active = 0
        self.hung_up = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.active += 1
        try:
            await self.gate.wait()
            if self.status != 200:
                error = {"error": {"message": "scripted", "type": "server_error", "code": None}}
                return web.json_response(error, status=self.status)
            prompt, completion = self.usage
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            if body.get("stream"):
                return await self._stream(request, usage)
            message = {"role": "assistant", "content": "ok"}
            return web.json_response(
                {
                    "id": "cmpl-1",
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": usage,
                }
            )
        except asyncio.CancelledError:
            self.hung_up += 1
            raise
        finally:
            self.active -= 1

    async def _stream(self, request: web.Request, usage: dict[str, int]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = '{"id":"c","object":"chat.completion.chunk","choices":'
        await resp.write(f'data: {chunk}[{{"index":0,"delta":{{"content":"ok"}}}}]}}\n\n'.encode())
        counts = ",".join(f'"{name}":{value}' for name, value in usage.items())
        await resp.write(f'data: {chunk}[],"usage":{{{counts}}}}}\n\n'.encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@contextlib.asynccontextmanager
async def serve_scripted(backend: ScriptedBackend) -> AsyncIterator[str]:
    """Serve ``backend`` on a free port, cancelling a handler when its caller hangs up."""
    async with serve_app(backend.app(), handler_cancellation=True) as url:
        yield url
