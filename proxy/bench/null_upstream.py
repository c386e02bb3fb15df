"""A null backend for overhead measurements and for tests of the proxy's own bookkeeping
(shared limits across replicas): answers every generation at once (or after ``delay_s``) with
a fixed usage, so all time measured is the proxy's. With ``delay_per_token_s`` a generation
takes its ``max_tokens`` times that, as an engine's would. Counts what it serves and runs."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

USAGE = {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}


class NullUpstream:
    def __init__(
        self,
        delay_s: float = 0.0,
        usage: dict[str, int] | None = None,
        *,
        delay_per_token_s: float = 0.0,
    ) -> None:
        self.delay_s = delay_s
        self.delay_per_token_s = delay_per_token_s
        self.usage = usage or USAGE
        self.served = 0
        self.served_by_user: dict[str, int] = {}  # by the body's "user" field
        self.running = 0
        self.max_running = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._ok)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        return app

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        body = {"object": "list", "data": [{"id": "null", "object": "model"}]}
        return web.json_response(body)

    async def _generate(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = orjson.loads(raw)
        delay = self.delay_s
        if self.delay_per_token_s:
            delay += self.delay_per_token_s * float(body.get("max_tokens") or 0)
        user = str(body.get("user", ""))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            if delay:
                await asyncio.sleep(delay)
        finally:
            self.running -= 1
        self.served += 1
        self.served_by_user[user] = self.served_by_user.get(user, 0) + 1
        body = {
            "id": "null",
            "object": "chat.completion",
            "model": "null",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
            "usage": self.usage,
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")
