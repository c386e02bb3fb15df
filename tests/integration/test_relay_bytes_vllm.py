"""Nothing lost against real vLLM: an answer through the proxy is the one vLLM gives the client
directly, byte for byte apart from the per-request ``id`` and ``created`` (vLLM makes them
fresh for every request) and the headers: streamed with and without ``include_usage`` (the
proxy always asks vLLM for usage and strips the chunk, keeping ``system_fingerprint``), and
not streamed."""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import pytest

from proxy.bench.inproc import auth, make_config, running_proxy
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import LONG_CONTEXT

pytestmark = [pytest.mark.integration, pytest.mark.engines(LONG_CONTEXT)]
TIMEOUT = aiohttp.ClientTimeout(total=120)
_PER_REQUEST = re.compile(rb'"id":"[^"]*"|"created":\d+')


def _same_but_fresh_ids(body: bytes) -> bytes:
    return _PER_REQUEST.sub(b"<per-request>", body)


async def test_the_client_gets_vllms_bytes(engines: EngineFarm) -> None:
    engine = engines.get(LONG_CONTEXT)
    cfg = make_config([{"url": engine.spec.url, "max_inflight": 4}])
    base_body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    asks: list[dict[str, Any]] = [
        {"stream": True},
        {"stream": True, "stream_options": {"include_usage": True}},
        {"stream": False},
    ]
    async with running_proxy(cfg) as (base, _), aiohttp.ClientSession(timeout=TIMEOUT) as s:
        for ask in asks:
            body = {**base_body, **ask}
            async with s.post(f"{engine.spec.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                direct = await resp.read()
            url = f"{base}/v1/chat/completions"
            async with s.post(url, json=body, headers=auth("normal")) as resp:
                assert resp.status == 200
                assert resp.headers.get("X-Request-Id")
                proxied = await resp.read()
            assert _same_but_fresh_ids(proxied) == _same_but_fresh_ids(direct), ask
            if ask["stream"]:
                assert proxied.endswith(b"data: [DONE]\n\n")
                assert (b'"usage"' in proxied) == ("stream_options" in ask)
            assert b'"system_fingerprint"' in proxied
