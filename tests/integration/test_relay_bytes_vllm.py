"""Nothing lost against real vLLM: an answer through the proxy is the one vLLM gave the proxy,
byte for byte. A recorder between the proxy and the engine keeps the body vLLM sent for that
very request: a busy engine merges several tokens into one delta, so a second, direct request
can be chunked otherwise. Streamed with ``include_usage`` the client gets every byte; without it
the proxy (which always asks vLLM for usage) strips the usage chunk and moves its
``system_fingerprint`` onto the terminal chunk, where vLLM puts it without ``include_usage``. Not streamed, the answer is also the one a direct request gets, apart
from the per-request ``id`` and ``created``."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.bench.inproc import auth, make_config, running_proxy, until
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import LONG_CONTEXT

pytestmark = [pytest.mark.integration, pytest.mark.engines(LONG_CONTEXT)]
TIMEOUT = aiohttp.ClientTimeout(total=120)
_PER_REQUEST = re.compile(rb'"id":"[^"]*"|"created":\d+')
_HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def _same_but_fresh_ids(body: bytes) -> bytes:
    return _PER_REQUEST.sub(b"<per-request>", body)


@asynccontextmanager
async def recording(upstream: str) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A pass-through to ``upstream`` that keeps each chat completion's response body."""
    bodies: list[bytes] = []
    session = aiohttp.ClientSession(timeout=TIMEOUT, auto_decompress=False)

    async def forward(request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with session.request(
            request.method,
            f"{upstream}{request.rel_url}",
            headers=headers,
            data=await request.read(),
        ) as upstream_resp:
            resp = web.StreamResponse(status=upstream_resp.status)
            for name, value in upstream_resp.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    resp.headers[name] = value
            await resp.prepare(request)
            body = bytearray()
            try:
                async for piece in upstream_resp.content.iter_any():
                    body += piece
                    await resp.write(piece)
                await resp.write_eof()
            except ConnectionResetError:
                # The proxy may close after a stream's [DONE] before this end's last write.
                async for piece in upstream_resp.content.iter_any():
                    body += piece
            finally:
                if request.path == "/v1/chat/completions":
                    bodies.append(bytes(body))
            return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", bodies
    finally:
        await runner.cleanup()
        await session.close()


def _as_without_include_usage(stream: bytes) -> bytes:
    """The stream vLLM sends without ``include_usage``, from the one it sent with it: no usage
    chunk, and its ``system_fingerprint`` on the terminal chunk instead (as the last field)."""
    events = stream.split(b"\n\n")
    usage = [e for e in events if e.startswith(b"data: {") and b'"choices":[]' in e]
    assert len(usage) == 1
    fingerprint = orjson.loads(usage[0][len(b"data: ") :])["system_fingerprint"]
    stamp = b',"system_fingerprint":' + orjson.dumps(fingerprint) + b"}"
    return b"\n\n".join(
        e[:-1] + stamp if b'"finish_reason":"' in e else e for e in events if e not in usage
    )


def _streamed_text(stream: bytes) -> str:
    text = ""
    for event in stream.split(b"\n\n"):
        if event.startswith(b"data: {"):
            for choice in orjson.loads(event[len(b"data: ") :])["choices"]:
                text += choice["delta"].get("content") or ""
    return text


async def test_the_client_gets_vllms_bytes(engines: EngineFarm) -> None:
    engine = engines.get(LONG_CONTEXT)
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
    async with (
        recording(engine.spec.url) as (recorder, sent),
        running_proxy(make_config([{"url": recorder, "max_inflight": 4}])) as (base, _),
        aiohttp.ClientSession(timeout=TIMEOUT) as s,
    ):
        async with s.post(
            f"{engine.spec.url}/v1/chat/completions", json={**base_body, "stream": False}
        ) as resp:
            assert resp.status == 200
            direct = await resp.read()
        direct_text = orjson.loads(direct)["choices"][0]["message"]["content"]
        for ask in asks:
            sent.clear()
            url = f"{base}/v1/chat/completions"
            async with s.post(url, json={**base_body, **ask}, headers=auth("normal")) as resp:
                assert resp.status == 200
                assert resp.headers.get("X-Request-Id")
                proxied = await resp.read()
            # The recorder keeps a body once vLLM has ended it, which may follow the client's end.
            await until(lambda: len(sent) >= 1, what=f"the recorded body of {ask}")
            assert len(sent) == 1, ask
            upstream = sent[0]
            if not ask["stream"]:
                assert proxied == upstream
                assert _same_but_fresh_ids(proxied) == _same_but_fresh_ids(direct)
            elif "stream_options" in ask:
                assert proxied == upstream
                assert b'"usage"' in proxied
            else:
                assert b'"usage"' in upstream  # the proxy asked for it, to bill
                assert proxied == _as_without_include_usage(upstream)
                assert b'"usage"' not in proxied
            if ask["stream"]:
                assert proxied.endswith(b"data: [DONE]\n\n")
                assert _streamed_text(proxied) == direct_text
            assert b'"system_fingerprint"' in proxied
