"""An engine whose adapter loads never answer: what a hung ``/v1/load_lora_adapter`` does to
the proxy (real vLLM cannot be made to hang there)."""

from __future__ import annotations

import asyncio

from aiohttp import web


def hanging_load_engine(began: asyncio.Event) -> web.Application:
    """Sets ``began`` when a load reaches it, then holds the request for an hour."""

    async def hanging_load(request: web.Request) -> web.Response:
        began.set()
        await asyncio.sleep(3600)
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/load_lora_adapter", hanging_load)
    return app
