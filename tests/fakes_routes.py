"""An in-process backend that answers every model route the way vLLM shapes it, and records what
it received; for the faults a real engine cannot be made to show (a Responses stream cut before
its last event)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDictProxy

from proxy.api.routes import POST_PATHS
from proxy.bench.inproc import serve_app

USAGE = {"prompt_tokens": 5, "total_tokens": 5, "completion_tokens": 0}
RESPONSES_USAGE = {"input_tokens": 6, "output_tokens": 4, "total_tokens": 10}


@dataclass
class Received:
    path: str
    headers: CIMultiDictProxy[str]
    body: dict[str, Any]


@dataclass
class RoutesBackend:
    """``cut_responses_stream``: the Responses stream ends before ``response.completed``."""

    cut_responses_stream: bool = False
    tokenize_status: int = 200  # else /tokenize answers this status with a vLLM-shaped error
    received: list[Received] = field(default_factory=list)
    # Set: /tokenize and /detokenize wait for it (a tokenizer busy with a long prompt).
    tokenize_gate: asyncio.Event | None = None
    tokenizing: int = 0  # tokenizer calls waiting at the gate now
    version_calls: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/v1/models", self._models)
        for path in POST_PATHS:
            app.router.add_post(path, self._answer)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _version(self, request: web.Request) -> web.Response:
        self.version_calls += 1
        return web.json_response({"version": "0.32.0"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(Received(request.path, request.headers, body))
        if request.path == "/v1/responses":
            if body.get("stream"):
                return await self._responses_stream(request)
            return web.json_response({"object": "response", "usage": RESPONSES_USAGE})
        if body.get("stream"):
            return await self._chat_stream(request)
        if request.path == "/tokenize" and self.tokenize_status != 200:
            error = {"message": "scripted", "type": "BadRequestError", "code": 400}
            return web.json_response({"error": error}, status=self.tokenize_status)
        if request.path in ("/tokenize", "/detokenize"):
            if self.tokenize_gate is not None:
                self.tokenizing += 1
                try:
                    await self.tokenize_gate.wait()
                finally:
                    self.tokenizing -= 1
            return web.json_response({"count": 2, "tokens": [1, 2], "max_model_len": 2048})
        return web.json_response({"object": "list", "data": [], "usage": USAGE})

    async def _chat_stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
        await resp.write(b'data: {"choices":[{"index":0,"text":"ok"}]}\n\n')
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _responses_stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        created = {"type": "response.created", "response": {"status": "in_progress"}}
        await resp.write(_event("response.created", created))
        delta = {"type": "response.output_text.delta", "delta": "ok"}
        await resp.write(_event("response.output_text.delta", delta))
        if not self.cut_responses_stream:
            done = {"type": "response.completed", "response": {"usage": RESPONSES_USAGE}}
            await resp.write(_event("response.completed", done))
        await resp.write_eof()
        return resp


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"


@contextlib.asynccontextmanager
async def serve_routes(backend: RoutesBackend) -> AsyncIterator[str]:
    async with serve_app(backend.app()) as url:
        yield url
