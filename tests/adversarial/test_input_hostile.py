"""Hostile client input against the real app (create_app, its middleware and its pipeline) with
an in-process backend, case by case: deep nesting, OpenAI's nulls, encodings, slow bodies, aiohttp's
own errors, unexpected exceptions, usage past the estimate. The fuzz is test_fuzz.py."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import math
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import exchange, is_openai_error, request_bytes
from proxy.bench.inproc import SECRET, auth, make_config, running_proxy
from proxy.config.loader import parse_config
from proxy.request.inbound import parse_body
from proxy.server.app import create_app
from proxy.server.json_errors import json_errors
from tests.helpers.answers import assert_openai_error
from tests.helpers.clock import FakeClock
from tests.helpers.encoding_cases import CASES as ENCODING_CASES
from tests.helpers.fuzz_strategies import deep_raw, encode, nested
from tests.helpers.rig import BODY, error_of, rig, tenants
from tests.helpers.timing import timer_lateness_s


@contextlib.asynccontextmanager
async def proxy_app(
    max_body_bytes: int | None = None, **input_knobs: Any
) -> AsyncIterator[tuple[TestClient[Any, Any], str]]:
    backend = FakeVLLM()
    async with backend.serve() as url:
        config = make_config([{"url": url}])
        if max_body_bytes is not None:
            config["limits"] = {"max_body_bytes": max_body_bytes}
        config["tiers"]["low"]["max_tokens"] = 100  # a capped tier: max_tokens null must pass
        if input_knobs:
            config["input"] = input_knobs
        app = create_app(parse_config(yaml.safe_dump(config), "test"), secret=SECRET)
        async with TestClient(TestServer(app)) as client:
            yield client, url


# -- targeted ------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [64, 65, 300, 2000])
async def test_nesting_past_the_limit_is_a_400_before_any_backend(depth: int) -> None:
    async with proxy_app() as (client, _):
        # depth levels of content nesting under messages[0]: the body's own depth is depth + 3
        body = {"model": "tiny", "messages": [{"role": "user", "content": nested(depth)}]}
        data = encode(body) if depth < 250 else deep_raw(depth)
        resp = await client.post("/v1/chat/completions", data=data, headers=auth("low"))
        raw = await resp.read()
        assert resp.status == 400, raw[:200]
        assert orjson.loads(raw)["error"]["code"] == "json_too_deep"


async def test_openai_nulls_are_absent() -> None:
    async with proxy_app() as (client, _):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "n": None,
            "stream": None,
            "max_tokens": None,
            "stream_options": None,
        }
        resp = await client.post("/v1/chat/completions", json=body, headers=auth("low"))
        assert resp.status == 200, await resp.text()


@pytest.mark.parametrize(
    ("encoding", "data", "status", "code"),
    [
        ("br", b"\x0b\x02\x80{}\x03", 415, "unsupported_content_encoding"),
        ("gzip", b"not gzip at all", 400, "invalid_content_encoding"),
        ("deflate", b"\x78\x9c garbage", 400, "invalid_content_encoding"),
        ("gzip", gzip.compress(b" " * (2 * 1024 * 1024)), 413, "request_too_large"),
    ],
)
async def test_bad_or_unsupported_encodings_get_json(
    encoding: str, data: bytes, status: int, code: str
) -> None:
    async with proxy_app(max_body_bytes=1024 * 1024) as (client, _):
        headers = {**auth("low"), "Content-Encoding": encoding}
        resp = await client.post("/v1/chat/completions", data=data, headers=headers)
        raw = await resp.read()
        assert resp.status == status, raw
        assert_openai_error(resp.status, resp.content_type, raw)
        assert orjson.loads(raw)["error"]["code"] == code


async def test_gzip_body_is_decoded_and_forwarded_as_identity() -> None:
    async with proxy_app() as (client, _):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "zipped"}]}
        headers = {**auth("low"), "Content-Encoding": "gzip", "Content-Type": "application/json"}
        resp = await client.post(
            "/v1/chat/completions", data=gzip.compress(encode(body)), headers=headers
        )
        assert resp.status == 200, await resp.text()


async def test_a_slow_body_gets_408_within_the_knob() -> None:
    async with proxy_app(body_read_timeout_s=0.3) as (client, _):
        server = client.server
        reader, writer = await asyncio.open_connection(server.host, server.port)
        key = auth("low")["Authorization"]
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: {key}\r\nContent-Length: 100\r\n\r\n".encode()
            + b'{"model":'  # and nothing more
        )
        await writer.drain()
        started = asyncio.get_running_loop().time()
        # A timer of the test's own at the knob, on the same loop: as late as the proxy's.
        reference = asyncio.create_task(timer_lateness_s(0.3))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
        waited = asyncio.get_running_loop().time() - started
        took_knob = await reference
        writer.close()
        assert head.startswith(b"HTTP/1.1 408"), head
        assert b"application/json" in head
        assert 0.25 <= waited < took_knob + 1.5, (waited, took_knob)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/nothing-here", 404),
        ("DELETE", "/healthz", 405),
        ("GET", "/v1/chat/completions", 405),
        ("GET", "/tokenize", 405),
        ("PUT", "/v1/embeddings", 405),
    ],
)
async def test_aiohttp_errors_and_unknown_paths_are_json(
    method: str, path: str, status: int
) -> None:
    async with proxy_app() as (client, _):
        resp = await client.request(method, path)
        raw = await resp.read()
        assert resp.status == status
        assert_openai_error(resp.status, resp.content_type, raw)


async def test_an_unexpected_exception_is_json_and_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken(request: web.Request) -> web.Response:
        raise RecursionError("deep")

    app = web.Application(middlewares=[json_errors])
    app.router.add_get("/broken", broken)
    async with TestClient(TestServer(app)) as client:
        with caplog.at_level("INFO"):
            resp = await client.get("/broken")
            raw = await resp.read()
        assert resp.status == 500
        assert_openai_error(resp.status, resp.content_type, raw)
        mine = [r for r in caplog.records if "RecursionError" in r.getMessage()]
        assert len(mine) == 1 and mine[0].exc_info is None
        assert all(r.exc_info is None for r in caplog.records)


@pytest.mark.parametrize("usage", [(1_000, 200), (10**7, 10**7)])
async def test_tpm_overage_makes_the_next_request_429_with_the_exact_retry_after(
    clock: FakeClock, usage: tuple[int, int]
) -> None:
    backend = FakeVLLM(usage=usage)  # far past what the request reserved
    async with backend.serve() as url:
        config = make_config([{"url": url}], tenants=tenants(tokens_per_minute=600))
        async with rig(config, clock) as r:
            assert (await r.chat()).status == 200
            second = await r.chat()
            assert second.status == 429
            assert (await error_of(second))["code"] == "rate_limit_exceeded"
            cfg = r.state.config
            reserved = parse_body(
                orjson.dumps(BODY), "chat", cfg.tiers["normal"], cfg.limits, cfg.scheduling
            )
            need = reserved.prompt_tokens + reserved.expected_output
            # The bucket holds 600 - 1,200 = -600, or for 20 M tokens used -600 as well: the
            # debt is capped at one minute of the limit. The reservation refills at 10 tokens/s.
            assert second.headers["Retry-After"] == str(math.ceil((600 + need) / 10))
            assert r.state.limits.concurrent("tenant-normal") == 0


@pytest.mark.parametrize(
    ("name", "encoding", "data", "status", "code"),
    ENCODING_CASES,
    ids=[c[0] for c in ENCODING_CASES],
)
async def test_encoded_bodies_on_the_listeners_production_serves_with(
    name: str, encoding: str, data: bytes, status: int, code: str | None
) -> None:
    """As TestServer above, but on ``Listeners`` (the connection gate makes each connection's
    handler): aiohttp's own decompression must be off there too, or a good body is decoded
    twice and a corrupt one fails inside aiohttp's payload (500 on the C parser)."""
    async with contextlib.AsyncExitStack() as stack:
        url = await stack.enter_async_context(FakeVLLM().serve())
        base, _ = await stack.enter_async_context(running_proxy(make_config([{"url": url}])))
        host, port = base.removeprefix("http://").rsplit(":", 1)
        headers = {**auth("low"), "Content-Type": "application/json", "Content-Encoding": encoding}
        req = request_bytes("POST", "/v1/chat/completions", headers, data)
        resp = await exchange(host, int(port), req)
    assert resp.status == status, (name, resp.body[:300])
    if status != 200:
        assert is_openai_error(resp), resp.body[:300]
        if code is not None:
            assert resp.error_code() == code
