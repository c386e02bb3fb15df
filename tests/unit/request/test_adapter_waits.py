"""An adapter request never waits for what cannot come in time (the proxy in process, a fake
engine): a load that hangs answers the request waiting for it at its tier's queue timeout, not
at the backend's `adapter_load_timeout_s` (red team F8), and a queued adapter request that a
reload leaves with no backend able to serve it is answered 404 at once, as a new request for it
would be, not 503 at its queue timeout."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import auth, make_config, running_proxy, serve_app, until
from proxy.config.loader import parse_config

ADAPTERS = {"lora-a": {"path": "/adapters/lora-a", "base_model": "tiny", "shared": True}}


def _engine(release: asyncio.Event, loading: asyncio.Event) -> web.Application:
    """Generations of more than 100 tokens run until ``release``; a load never answers."""

    async def script(request: web.Request, n: int) -> web.StreamResponse | None:
        if (await request.json())["max_tokens"] > 100:
            await release.wait()
        return None

    async def load(request: web.Request) -> web.Response:
        loading.set()
        await asyncio.sleep(3600)
        return web.Response(text="Success")

    app = FakeVLLM(script=script).app()
    app.router.add_post("/v1/load_lora_adapter", load)
    return app


def _config(url: str, **backend: Any) -> dict[str, Any]:
    cfg = {"url": url, "max_inflight": 1, **backend}
    return make_config(
        [cfg],
        adapters=ADAPTERS,
        # Long enough for the load to reach the engine on a busy machine before the queue time ends.
        tiers={"high": {"queue_timeout_s": 2.0}},
        backend_health={"models_interval_s": 3600},
    )


async def _post(
    client: aiohttp.ClientSession, base: str, model: str, max_tokens: int
) -> tuple[int, dict[str, Any]]:
    body = {"model": model, "prompt": "hi", "max_tokens": max_tokens}
    async with client.post(f"{base}/v1/completions", json=body, headers=auth("high")) as resp:
        return resp.status, await resp.json()


async def test_a_hung_load_answers_its_request_at_the_tiers_queue_timeout() -> None:
    release, loading = asyncio.Event(), asyncio.Event()
    backend = {"max_loras": 2, "load_adapters": True, "adapter_load_timeout_s": 3600}
    async with (
        serve_app(_engine(release, loading), handler_cancellation=True) as url,
        running_proxy(_config(url, **backend)) as (base, state),
        aiohttp.ClientSession() as client,
    ):
        status, body = await _post(client, base, "lora-a", 2)
        await asyncio.wait_for(loading.wait(), 30)  # its load began, and hangs still
        assert status == 503, body
        assert body["error"]["code"] == "adapter_load_failed"
        assert "queue timeout" in body["error"]["message"]
        assert "lora-a" in state.pool.all()[0].adapters.loading  # kept for the next request
        # The next one waits for that load, to its own queue timeout: a 503 with Retry-After,
        # as docs/routes.md promises for every 503 (red team F4 of round g: it had none).
        body = {"model": "lora-a", "prompt": "hi", "max_tokens": 2}
        async with client.post(f"{base}/v1/completions", json=body, headers=auth("high")) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"


async def test_a_reload_leaving_no_backend_for_an_adapter_answers_its_queued_requests() -> None:
    release, loading = asyncio.Event(), asyncio.Event()
    backend = {"max_loras": 2, "load_adapters": True}
    cfg = _config("", **backend)
    cfg["tiers"]["high"]["queue_timeout_s"] = 600
    async with (
        serve_app(_engine(release, loading), handler_cancellation=True) as url,
        aiohttp.ClientSession() as client,
    ):
        cfg["backends"][0]["url"] = url
        async with running_proxy(cfg) as (base, state):
            long = asyncio.create_task(_post(client, base, "tiny", 250))  # the one slot
            await until(lambda: state.pool.all()[0].inflight == 1, 30, "the long one", state)
            queued = asyncio.create_task(_post(client, base, "lora-a", 2))
            await until(lambda: state.queue.depth("high") == 1, 30, "the queued one", state)
            del cfg["backends"][0]["max_loras"]  # no backend runs adapters any more
            state.apply(parse_config(yaml.safe_dump(cfg), "reloaded"))
            status, body = await queued  # at once: the long generation still runs
            assert not long.done()
            assert status == 404, body
            assert body["error"]["code"] == "model_not_found"
            release.set()
            assert (await long)[0] == 200


async def test_a_reload_revoking_a_tenants_access_answers_its_queued_requests() -> None:
    """Red team F3 of round g: a queued request was served, and billed, 12.8 s after a reload
    took its tenant's access to the adapter away."""
    release, loading = asyncio.Event(), asyncio.Event()
    cfg = _config("", max_loras=2, load_adapters=True)
    cfg["tiers"]["high"]["queue_timeout_s"] = 600
    async with (
        serve_app(_engine(release, loading), handler_cancellation=True) as url,
        aiohttp.ClientSession() as client,
    ):
        cfg["backends"][0]["url"] = url
        async with running_proxy(cfg) as (base, state):
            long = asyncio.create_task(_post(client, base, "tiny", 250))  # the one slot
            await until(lambda: state.pool.all()[0].inflight == 1, 30, "the long one", state)
            queued = asyncio.create_task(_post(client, base, "lora-a", 2))
            await until(lambda: state.queue.depth("high") == 1, 30, "the queued one", state)
            cfg["adapters"]["lora-a"] = {**ADAPTERS["lora-a"], "shared": False, "tiers": ["low"]}
            state.apply(parse_config(yaml.safe_dump(cfg), "reloaded"))
            status, body = await queued  # at once: the long generation still runs
            assert not long.done()
            assert status == 404, body
            assert body["error"]["code"] == "model_not_found"
            release.set()
            assert (await long)[0] == 200
