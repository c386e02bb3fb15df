"""The routes beside generation (proxy.server.endpoints, proxy.server.admin) on the whole app, against an
in-process backend."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import SECRET, auth, make_config
from proxy.config.loader import parse_config
from proxy.config.server import Server
from proxy.config.tenants import hash_key
from proxy.server.app import create_admin_app, create_app
from proxy.server.listeners import Listeners
from proxy.server.state import STATE
from tests.helpers.clock import FakeClock
from tests.helpers.paths import TINY_MODEL_DIR

ADMIN = {"Authorization": "Bearer admin-secret"}

Client = TestClient[web.Request, web.Application]


@contextlib.asynccontextmanager
async def proxy(clock: FakeClock, *, admin: bool = True) -> AsyncIterator[tuple[Client, str]]:
    """The whole app (monitor included) over one scripted backend; yields (client, its url)."""
    async with FakeVLLM().serve() as url:
        extra: dict[str, Any] = {"admin_keys": [{"sha256": hash_key("admin-secret")}]}
        config = make_config([{"url": url}], **(extra if admin else {}))
        app = create_app(parse_config(yaml.safe_dump(config)), secret=SECRET, clock=clock)
        async with TestClient(TestServer(app)) as client:
            yield client, url


async def error_code(resp: Any) -> str:
    body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    code: str = body["error"]["code"]
    return code


async def test_models_needs_a_tenant_key(clock: FakeClock) -> None:
    async with proxy(clock) as (client, _):
        async with client.get("/v1/models") as resp:
            assert resp.status == 401 and await error_code(resp) == "invalid_api_key"
        async with client.get("/v1/models", headers=ADMIN) as resp:
            assert resp.status == 401  # an admin key is no tenant key
        async with client.get("/v1/models", headers=auth("low")) as resp:
            assert resp.status == 200
            body = await resp.json()
            assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["tiny"]


async def test_probes_and_unknown_urls(clock: FakeClock) -> None:
    async with proxy(clock) as (client, _):
        async with client.get("/healthz") as resp:
            assert resp.status == 200 and await resp.json() == {"status": "ok"}
        async with client.get("/readyz") as resp:
            assert resp.status == 200 and await resp.json() == {"ready": True}
        async with client.post("/v1/audio/speech", headers=auth("high")) as resp:
            assert resp.status == 404 and await error_code(resp) == "unknown_url"
        async with client.get("/metrics", headers=ADMIN) as resp:
            assert "tierproxy_config_generation 1.0" in await resp.text()


async def test_admin_is_off_without_admin_keys(clock: FakeClock) -> None:
    async with proxy(clock, admin=False) as (client, _):
        resp = await client.get("/admin/backends", headers=ADMIN)
        assert resp.status == 404 and await error_code(resp) == "admin_disabled"


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[]", b'{"drain": true}', b'{"url": 5}', b'{"url": "x", "drain": "yes"}'],
)
async def test_admin_drain_refuses_a_malformed_body(clock: FakeClock, body: bytes) -> None:
    async with proxy(clock) as (client, _):
        resp = await client.post("/admin/backends/drain", data=body, headers=ADMIN)
        assert resp.status == 400
        assert "drain" in (await resp.json())["error"]["message"]


async def test_admin_drain_takes_a_backend_out_and_back(clock: FakeClock) -> None:
    async with proxy(clock) as (client, url):
        state = client.app[STATE] if client.app is not None else None
        assert state is not None
        drain = "/admin/backends/drain"
        async with client.post(drain, json={"url": url}, headers=auth("high")) as resp:
            assert resp.status == 401  # a tenant key is no admin key
        async with client.post(drain, json={"url": url + "9"}, headers=ADMIN) as resp:
            assert resp.status == 404 and await error_code(resp) == "unknown_backend"
        async with client.post(drain, json={"url": url}, headers=ADMIN) as resp:
            view = await resp.json()
            assert resp.status == 200 and view["draining"] is True and view["available"] is False
        async with client.get("/readyz") as resp:
            assert resp.status == 503 and await resp.json() == {"ready": False}
        async with client.get("/admin/backends", headers=ADMIN) as resp:
            (listed,) = (await resp.json())["backends"]
            assert listed["url"] == url and listed["draining"] is True
        async with client.post(drain, json={"url": url, "drain": False}, headers=ADMIN) as resp:
            assert resp.status == 200 and (await resp.json())["draining"] is False
        async with client.get("/readyz") as resp:
            assert resp.status == 200
        assert not state.pool.all()[0].draining


async def test_admin_listen_serves_metrics_and_admin_there_only(clock: FakeClock) -> None:
    async with FakeVLLM().serve() as url:
        config = make_config(
            [{"url": url}],
            admin_keys=[{"sha256": hash_key("admin-secret")}],
            admin_listen={"host": "127.0.0.1", "port": 0},
        )
        app = create_app(parse_config(yaml.safe_dump(config)), secret=SECRET, clock=clock)
        async with Listeners(Server()) as listeners:
            public = await listeners.add(app, "127.0.0.1", 0)
            admin = await listeners.add(create_admin_app(app), "127.0.0.1", 0)
            async with aiohttp.ClientSession() as http:
                for path in ("/metrics", "/admin/backends"):
                    async with http.get(f"http://127.0.0.1:{public}{path}", headers=ADMIN) as r:
                        assert r.status == 404, path
                base = f"http://127.0.0.1:{admin}"
                async with http.get(f"{base}/metrics") as resp:
                    assert resp.status == 200
                    assert "tierproxy_config_generation 1.0" in await resp.text()
                async with http.get(f"{base}/admin/backends", headers=ADMIN) as resp:
                    assert resp.status == 200 and (await resp.json())["backends"][0]["url"] == url
                async with http.get(f"{base}/v1/models", headers=auth("low")) as resp:
                    assert resp.status == 404  # tenants' routes stay on the public listener
                async with http.get(f"http://127.0.0.1:{public}/healthz") as resp:
                    assert resp.status == 200


async def test_metrics_on_the_client_listener_needs_an_admin_key(clock: FakeClock) -> None:
    """It names every tenant and its usage: without a key, 401 and no tenant name; with no
    admin key configured, not served; on admin_listen, open (test above)."""
    async with proxy(clock) as (client, _):
        async with client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            headers=auth("high"),
        ) as resp:
            assert resp.status == 200
        async with client.get("/metrics", headers=ADMIN) as resp:
            assert resp.status == 200 and "tenant-high" in await resp.text()
        for headers in ({}, auth("high"), {"Authorization": "Bearer wrong"}):
            async with client.get("/metrics", headers=headers) as resp:
                text = await resp.text()
                assert resp.status == 401 and "tenant" not in text, headers
    async with (
        proxy(clock, admin=False) as (client, _),
        client.get("/metrics", headers=auth("high")) as resp,
    ):
        assert resp.status == 404 and await error_code(resp) == "admin_disabled"


async def test_the_tokenizer_is_loaded_before_the_listener_opens(
    clock: FakeClock, tmp_path: Path
) -> None:
    """With kv_cache on, the model's tokenizer is loaded during the app's start (which the
    listener waits for): the first burst of requests does not load it (docs/benchmarks.md)."""
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL_DIR, model)  # a directory no other test has loaded
    async with FakeVLLM().serve() as url:
        config = make_config([{"url": url}], kv_cache={"enabled": True, "tokenizer": str(model)})
        app = create_app(parse_config(yaml.safe_dump(config)), secret=SECRET, clock=clock)
        blocks = app[STATE].prompt_blocks
        assert str(model) not in blocks._models
        async with TestClient(TestServer(app)):
            load = blocks._models[str(model)]
            assert load.done() and load.result() is not None
