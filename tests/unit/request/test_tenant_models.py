"""Models per tenant (`models:` on a tenant or its tier): a model the key may not use is
answered exactly as one that does not exist, and `/v1/models` lists only what the key may use."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import SECRET, auth, make_config
from proxy.config.loader import parse_config
from proxy.config.tenants import hash_key
from proxy.server.app import create_app
from proxy.server.state import STATE, ProxyState
from tests.helpers.clock import FakeClock

Client = TestClient[web.Request, web.Application]
SERVED = ("tiny", "big-1", "big-2")


class TwoFamilies(FakeVLLM):
    """A backend that serves ``SERVED``."""

    async def _models(self, request: web.Request) -> web.Response:
        cards = [{"id": name, "object": "model"} for name in SERVED]
        return web.json_response({"object": "list", "data": cards})


@contextlib.asynccontextmanager
async def proxy(clock: FakeClock) -> AsyncIterator[tuple[Client, ProxyState, FakeVLLM]]:
    """tenant-high may use tiny only (its own list), tenant-normal big-* (its tier's list),
    tenant-low everything."""
    backend = TwoFamilies()
    async with backend.serve() as url:
        config = make_config(
            [{"url": url}],
            tiers={"normal": {"models": ["big-*"]}},
            tenants=[
                {
                    "name": "tenant-high",
                    "tier": "high",
                    "keys": [{"sha256": hash_key("key-high")}],
                    "models": ["tiny"],
                },
                {
                    "name": "tenant-normal",
                    "tier": "normal",
                    "keys": [{"sha256": hash_key("key-normal")}],
                },
                {"name": "tenant-low", "tier": "low", "keys": [{"sha256": hash_key("key-low")}]},
            ],
        )
        app = create_app(parse_config(yaml.safe_dump(config)), secret=SECRET, clock=clock)
        async with TestClient(TestServer(app)) as client:
            state = app[STATE]
            assert state.monitor is not None
            await state.monitor.probe_all()  # learns the backend's models
            yield client, state, backend


async def chat(client: Client, tier: str, model: str | None) -> tuple[int, dict[str, Any]]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if model is not None:
        body["model"] = model
    async with client.post("/v1/chat/completions", json=body, headers=auth(tier)) as resp:
        return resp.status, await resp.json()


async def listed(client: Client, tier: str) -> list[str]:
    async with client.get("/v1/models", headers=auth(tier)) as resp:
        assert resp.status == 200
        return sorted(card["id"] for card in (await resp.json())["data"])


async def test_a_forbidden_model_is_answered_as_an_unknown_one(clock: FakeClock) -> None:
    async with proxy(clock) as (client, _, backend):
        for tier, allowed, forbidden in (("high", "tiny", "big-1"), ("normal", "big-2", "tiny")):
            assert (await chat(client, tier, allowed))[0] == 200
            status, forbidden_answer = await chat(client, tier, forbidden)
            unknown_status, unknown_answer = await chat(client, tier, "nope")
            assert status == unknown_status == 404
            assert forbidden_answer["error"]["code"] == "model_not_found"
            # No oracle: the same answer but for the name asked for.
            text = str(forbidden_answer).replace(forbidden, "nope")
            assert text == str(unknown_answer)
            assert forbidden not in str(unknown_answer)
        assert [b.body["model"] for b in backend.received] == [
            "tiny",
            "big-2",
        ]  # refused ones not sent


async def test_models_lists_only_what_the_key_may_use(clock: FakeClock) -> None:
    async with proxy(clock) as (client, _, _backend):
        assert await listed(client, "high") == ["tiny"]  # the tenant's list
        assert await listed(client, "normal") == ["big-1", "big-2"]  # its tier's default
        assert await listed(client, "low") == sorted(SERVED)  # no list: every model


async def test_a_restricted_key_must_name_its_model(clock: FakeClock) -> None:
    async with proxy(clock) as (client, _, backend):
        status, answer = await chat(client, "high", None)
        assert status == 400 and answer["error"]["param"] == "model"
        assert (await chat(client, "low", None))[0] == 200  # unrestricted: vLLM's default
        assert len(backend.received) == 1
