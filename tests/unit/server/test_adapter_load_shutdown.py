"""The proxy's shutdown cancels the adapter loads under way (proxy.backends.adapter_loader owns
them). A load outlives the client that asked for it (the next request for the adapter needs it);
one that hangs at the backend when the proxy stops ends with the proxy, nothing is left pending,
and the slot it held is given back. (Requests still waiting on a load keep the listener's drain
open until the load ends: within the backend's adapter_load_timeout_s.)"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import aiohttp
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import auth, make_config, running_proxy, serve_app


def _loads(loop: asyncio.AbstractEventLoop) -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks(loop) if t.get_name().startswith("load ")]


async def test_a_load_in_flight_at_shutdown_is_cancelled_and_nothing_is_left_pending() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    load_began = asyncio.Event()

    async def hanging_load(request: web.Request) -> web.Response:
        load_began.set()
        await asyncio.sleep(3600)  # an engine that never answers the load
        return web.Response()

    app = FakeVLLM().app()
    app.router.add_post("/v1/load_lora_adapter", hanging_load)
    async with serve_app(app, handler_cancellation=True) as url:
        backend = {"url": url, "max_inflight": 4, "max_loras": 2, "load_adapters": True}
        adapters = {"lora-a": {"path": "/adapters/a", "base_model": "tiny", "shared": True}}
        config = make_config([backend], adapters=adapters)
        async with aiohttp.ClientSession() as client:
            async with running_proxy(config) as (base, state):
                body = {"model": "lora-a", "prompt": "hi", "max_tokens": 1}
                request = asyncio.create_task(
                    client.post(f"{base}/v1/completions", json=body, headers=auth("high"))
                )
                async with asyncio.timeout(10):
                    await load_began.wait()
                [task] = _loads(loop)  # the loader's task, blocked at the engine
                slots = state.pool.all()[0].adapters
                request.cancel()  # the client leaves; its load goes on
                async with asyncio.timeout(10):
                    while slots.inflight:  # the proxy saw it leave and freed its lease
                        await asyncio.sleep(0.01)
                assert not task.done() and "lora-a" in slots.loading
            # The proxy has stopped: its load task was cancelled and awaited, not abandoned.
            assert task.cancelled()
            assert _loads(loop) == []
            assert not slots.loading and "lora-a" not in slots.held  # the slot given back
    del task, request
    gc.collect()
    assert not any("destroyed but it is pending" in str(c.get("message")) for c in reported)
