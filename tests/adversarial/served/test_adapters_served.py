"""The promise "a tenant's adapter is private, and one bad value in the file refuses no tenant"
against `tierproxy serve` on its default loop, with an engine whose /v1/models lists an adapter
the catalogue does not name (found by the red team of 2026-12-02, issue 34; the faults as they
were):

1. An adapter removed from `adapters:` (or renamed) while an engine still held it answered
   every tenant 200, unpriced, and every tenant's /v1/models listed it with its path.
2. A key written twice (`acme-sql:` under `adapters:` twice) was applied silently, the last
   entry winning: a private adapter shared, its price gone.
The in-process twins: tests/unit/config/test_adapters_config.py, test_load_failures.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import exchange, json_request, request_bytes
from proxy.bench.hostile.served import NullBackend, ServedProxy, served_config
from proxy.bench.inproc import KEYS

STRAY = {"id": "gone-lora", "object": "model", "parent": "null", "root": "/srv/gone-lora"}
OWN = {"path": "/srv/own-lora", "base_model": "null", "tenants": ["tenant-high"]}


class EngineWithAStray(FakeVLLM):
    """The fake engine whose /v1/models also lists an adapter no catalogue names."""

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": "null", "object": "model", "root": "null", "parent": None}, STRAY]
        return web.json_response({"object": "list", "data": data})


@pytest.fixture
def stray_backend() -> Iterator[NullBackend]:
    with NullBackend(EngineWithAStray(model="null", usage=(4, 4))) as upstream:
        yield upstream


async def _models(proxy: ServedProxy, tier: str) -> list[dict[str, object]]:
    headers = {"Authorization": f"Bearer {KEYS[tier]}"}
    answer = await exchange(
        proxy.host, proxy.port, request_bytes("GET", "/v1/models", headers, b"")
    )
    assert answer.status == 200
    data: list[dict[str, object]] = orjson.loads(answer.body)["data"]
    return data


async def _listed(proxy: ServedProxy) -> list[dict[str, object]]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        cards = await _models(proxy, "high")
        if any(c["id"] == "null" for c in cards):
            return cards
        await asyncio.sleep(0.1)
    raise AssertionError("the proxy never listed the backend's model")


def _chat(model: str, tier: str) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return json_request("/v1/chat/completions", body, KEYS[tier])


async def test_an_adapter_outside_the_catalogue_is_nobodys_and_a_doubled_key_is_refused(
    stray_backend: NullBackend, tmp_path: Path
) -> None:
    config = served_config(stray_backend.url, adapters={"own-lora": OWN})
    config["backends"][0]["max_loras"] = 2
    proxy = ServedProxy(config, tmp_path)
    proxy.start()
    try:
        high = await _listed(proxy)
        assert {c["id"] for c in high} == {"null", "own-lora"}  # the stray not listed
        assert all("root" not in c for c in high if c.get("parent"))  # no adapter's path
        assert {c["id"] for c in await _models(proxy, "low")} == {"null"}
        for tier in ("high", "low"):
            answer = await exchange(proxy.host, proxy.port, _chat("gone-lora", tier))
            assert answer.status == 404, answer.body  # before: 200 to every tenant
            assert b"model_not_found" in answer.body
        assert stray_backend.null.served == 0  # nothing reached the engine

        # The same adapter written twice, the second shared: refused, the old file in force.
        text = proxy.config_path.read_text()
        second = "adapters:\n  own-lora: {path: /srv/x, base_model: 'null', shared: true}\n"
        doubled = text.replace("adapters:\n", second, 1)
        assert doubled.count("own-lora:") == 2
        staged = proxy.config_path.with_suffix(".new")
        staged.write_text(doubled)
        staged.replace(proxy.config_path)
        os.kill(proxy.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "duplicate key 'own-lora'" not in proxy.log_path.read_text():
            assert time.monotonic() < deadline, proxy.log_path.read_text()[-2000:]
            await asyncio.sleep(0.1)
        assert {c["id"] for c in await _models(proxy, "low")} == {"null"}  # still private
    finally:
        proxy.stop()
