"""An engine that answers 404 for an adapter the proxy counted as held there (it restarted and
lost its runtime loads, or another replica unloaded it): the proxy stops counting it held and
the request goes round again, loading it this time, instead of its client (and every request
until the next /v1/models probe) meeting the 404; an engine that keeps answering 404 gets its
404 passed on once the request's attempts are spent (proxy.request.adapter_gate,
proxy.backends.adapter_slots)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import auth, make_config, running_proxy, serve_app

Script = Callable[[web.Request, int], Awaitable[web.StreamResponse | None]]
NOT_FOUND = {
    "error": {
        "message": "The model `lora-a` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
}


def _engine(script: Script, loads: list[str]) -> web.Application:
    """The fake engine answering generations by ``script``; each adapter load succeeds and is
    recorded in ``loads``."""

    async def load(request: web.Request) -> web.Response:
        loads.append((await request.json())["lora_name"])
        return web.Response(text="Success")

    app = FakeVLLM(script=script).app()
    app.router.add_post("/v1/load_lora_adapter", load)
    return app


async def test_a_404_for_a_held_adapter_loads_it_again_and_the_request_is_served() -> None:

    async def first_forgets(request: web.Request, n: int) -> web.StreamResponse | None:
        return web.json_response(NOT_FOUND, status=404) if n == 1 else None

    loads: list[str] = []
    app = _engine(first_forgets, loads)
    async with serve_app(app, handler_cancellation=True) as url:
        backend = {"url": url, "max_inflight": 4, "max_loras": 2, "load_adapters": True}
        adapters = {"lora-a": {"path": "/adapters/a", "base_model": "tiny", "shared": True}}
        config = make_config(
            [backend],
            adapters=adapters,
            backend_health={"models_interval_s": 3600},  # no probe corrects the view meanwhile
        )
        async with running_proxy(config) as (base, state), aiohttp.ClientSession() as client:
            body = {"model": "lora-a", "prompt": "hi", "max_tokens": 1}
            statuses = []
            for _ in range(2):
                async with client.post(
                    f"{base}/v1/completions", json=body, headers=auth("high")
                ) as resp:
                    statuses.append(resp.status)
            assert statuses == [200, 200]  # the first went round again after the 404
            assert loads == ["lora-a", "lora-a"]  # loaded again after the engine's 404
            assert "lora-a" in state.pool.all()[0].adapters.held
            assert state.budget.held == 0  # the dropped 404's bytes were given back


async def test_an_engine_that_keeps_forgetting_gets_its_404_passed_on_after_the_attempts() -> None:

    async def always_forgets(request: web.Request, n: int) -> web.StreamResponse | None:
        return web.json_response(NOT_FOUND, status=404)

    loads: list[str] = []
    app = _engine(always_forgets, loads)
    async with serve_app(app, handler_cancellation=True) as url:
        backend = {"url": url, "max_inflight": 4, "max_loras": 2, "load_adapters": True}
        adapters = {"lora-a": {"path": "/adapters/a", "base_model": "tiny", "shared": True}}
        config = make_config(
            [backend],
            adapters=adapters,
            backend_health={"models_interval_s": 3600, "max_attempts": 3},
        )
        async with running_proxy(config) as (base, state), aiohttp.ClientSession() as client:
            body = {"model": "lora-a", "prompt": "hi", "max_tokens": 1, "stream": True}
            async with client.post(
                f"{base}/v1/completions", json=body, headers=auth("high")
            ) as resp:
                assert resp.status == 404
                assert (await resp.json())["error"]["code"] == 404
            assert loads == ["lora-a"] * 3  # one load per attempt, then the engine's answer
            assert state.budget.held == 0


async def test_another_404_is_passed_on_and_forgets_nothing() -> None:
    # A route the engine lacks answers FastAPI's bare 404: that says nothing of its adapters
    # (red team 2026-12-02, finding 8: /v1/embeddings with an adapter made the proxy reload it
    # on every attempt and forget what the engine held, past max_loras).

    async def no_such_route(request: web.Request, n: int) -> web.StreamResponse | None:
        return web.json_response({"detail": "Not Found"}, status=404)

    loads: list[str] = []
    app = _engine(no_such_route, loads)
    async with serve_app(app, handler_cancellation=True) as url:
        backend = {"url": url, "max_inflight": 4, "max_loras": 2, "load_adapters": True}
        adapters = {"lora-a": {"path": "/adapters/a", "base_model": "tiny", "shared": True}}
        config = make_config([backend], adapters=adapters)
        async with running_proxy(config) as (base, state), aiohttp.ClientSession() as client:
            body = {"model": "lora-a", "prompt": "hi", "max_tokens": 1}
            for _ in range(2):
                async with client.post(
                    f"{base}/v1/completions", json=body, headers=auth("high")
                ) as resp:
                    assert resp.status == 404
            assert loads == ["lora-a"]  # loaded once, still counted as held
            assert "lora-a" in state.pool.all()[0].adapters.held
