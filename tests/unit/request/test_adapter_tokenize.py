"""The tokenizer's routes with an adapter as the model: a clear 400 naming the base model,
whether an engine holds the adapter or not (red team 2026-12-02, finding 11: the answer was a
false "every backend is running its cap of tokenizer calls" while no engine held it, and 200
once one did — telling any tenant what others had loaded)."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import auth, make_config, running_proxy, serve_app


@pytest.mark.parametrize("held", [False, True])
async def test_tokenize_with_an_adapter_names_its_base_model(held: bool) -> None:
    async def load(request: web.Request) -> web.Response:
        return web.Response(text="Success")

    app = FakeVLLM().app()
    app.router.add_post("/v1/load_lora_adapter", load)
    async with serve_app(app, handler_cancellation=True) as url:
        backend = {"url": url, "max_inflight": 4, "max_loras": 2, "load_adapters": True}
        adapters = {"lora-a": {"path": "/adapters/a", "base_model": "tiny", "shared": True}}
        config = make_config([backend], adapters=adapters)
        async with running_proxy(config) as (base, state), aiohttp.ClientSession() as client:
            if held:
                state.pool.all()[0].adapters.listed(frozenset({"lora-a"}), 0.0)
            body = {"model": "lora-a", "prompt": "hello"}
            async with client.post(f"{base}/tokenize", json=body, headers=auth("low")) as r:
                assert r.status == 400
                error = (await r.json())["error"]
            assert error["param"] == "model" and "`tiny`" in error["message"]
            body = {"model": "tiny", "prompt": "hello"}
            async with client.post(f"{base}/tokenize", json=body, headers=auth("low")) as r:
                assert r.status == 200  # the base model's tokenizer answers
