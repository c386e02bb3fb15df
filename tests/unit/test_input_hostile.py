"""Hostile client input against the real app (create_app, its middleware and its pipeline) with
an in-process backend: never a 5xx, every error OpenAI-shaped JSON, nothing left held.

The fuzz case count is ``TIERPROXY_FUZZ_CASES`` (default 2,000 under ``make test``, about 13 s;
the issue's adversarial run is ``TIERPROXY_FUZZ_CASES=10000``, about 65 s).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gzip
import json
import math
import os
import zlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.app import STATE, create_app
from proxy.config import parse_config
from proxy.inbound import parse_body
from proxy.json_errors import json_errors
from tests.clock import FakeClock
from tests.fakes import ScriptedBackend, serve_scripted
from tests.proxyrun import SECRET, auth, make_config
from tests.unit.test_pipeline import BODY, error_of, rig, tenants

FUZZ_CASES = int(os.environ.get("TIERPROXY_FUZZ_CASES", "2000"))
STATUSES: collections.Counter[int] = collections.Counter()


@contextlib.asynccontextmanager
async def proxy_app(
    max_body_bytes: int | None = None, **input_knobs: Any
) -> AsyncIterator[tuple[TestClient[Any, Any], str]]:
    backend = ScriptedBackend()
    async with serve_scripted(backend) as url:
        config = make_config([{"url": url}])
        if max_body_bytes is not None:
            config["limits"] = {"max_body_bytes": max_body_bytes}
        config["tiers"]["low"]["max_tokens"] = 100  # a capped tier: max_tokens null must pass
        if input_knobs:
            config["input"] = input_knobs
        app = create_app(parse_config(yaml.safe_dump(config), "test"), secret=SECRET)
        async with TestClient(TestServer(app)) as client:
            yield client, url


def assert_openai_error(status: int, content_type: str, raw: bytes) -> None:
    assert content_type == "application/json", (status, raw[:200])
    body = orjson.loads(raw)
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def nested(depth: int, leaf: object = "x") -> object:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"content": value}
    return value


def _deep_raw(depth: int) -> bytes:
    """A body nested past what orjson can write (built as text)."""
    inner = b'"x"'
    for i in range(depth):
        inner = b"[" + inner + b"]" if i % 2 else b'{"content":' + inner + b"}"
    return b'{"model":"tiny","messages":[{"role":"user","content":' + inner + b"}]}"


# -- the fuzz ------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
FIELDS = [
    "model",
    "messages",
    "prompt",
    "stream",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "stream_options",
    "tools",
    "priority",
    "vllm_xargs",
    "temperature",
]
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"]) | json_values},
    optional={"content": json_values, "name": json_values, "tool_calls": json_values},
)
body_objects = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just("tiny") | json_values,
        "messages": st.lists(message, max_size=3) | json_values,
        "stream": st.none() | st.booleans() | json_values,
        "n": st.none() | st.integers(-2, 3) | json_values,
        "max_tokens": st.none() | st.integers(-1, 300) | json_values,
        "stream_options": st.none() | st.just({"include_usage": True}) | json_values,
        "tools": json_values,
        "priority": json_values,
        "vllm_xargs": json_values,
    },
).map(lambda d: d if "messages" in d else {**d, "messages": [{"role": "user", "content": "hi"}]})


def encode(body: object) -> bytes:
    # The standard library writes what orjson refuses to: integers past 64 bits.
    return json.dumps(body).encode()


raw_bodies = st.one_of(
    body_objects.map(encode),
    st.dictionaries(st.sampled_from(FIELDS), json_values).map(encode),
    st.integers(1, 400).map(_deep_raw),
    st.integers(1, 1100).map(lambda d: b"[" * d + b"]" * d),
    st.binary(max_size=64),
    st.just(b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    st.just(b'{"messages": [{"role": "user", "content": "\\ud800"}], "n": 1e400}'),
)
encodings = st.sampled_from(["", "gzip", "deflate", "br", "zstd", "gzip, gzip", "x-garbage"])
header_sets = st.dictionaries(
    st.sampled_from(
        [
            "Connection",
            "Cookie",
            "Expect",
            "X-data-parallel-rank",
            "Content-Type",
            "Transfer-Encoding",
            "TE",
            "X-Vllm-Priority",
            "Accept-Encoding",
        ]
    ),
    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=12),
    max_size=3,
)


def compress(data: bytes, encoding: str, corrupt: bool) -> bytes:
    if encoding == "gzip":
        data = gzip.compress(data)
    elif encoding == "gzip, gzip":
        data = gzip.compress(gzip.compress(data))
    elif encoding == "deflate":
        data = zlib.compress(data)
    return data[: len(data) // 2] if corrupt else data


async def test_fuzzed_bodies_and_headers_never_get_a_5xx_nor_leak() -> None:
    async with proxy_app() as (client, _):
        state = client.app[STATE] if client.app is not None else None
        assert state is not None
        loop = asyncio.get_running_loop()

        @settings(
            max_examples=FUZZ_CASES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(
            raw=raw_bodies,
            encoding=encodings,
            corrupt=st.booleans(),
            headers=header_sets,
            endpoint=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
        )
        def case(
            raw: bytes, encoding: str, corrupt: bool, headers: dict[str, str], endpoint: str
        ) -> None:
            data = compress(raw, encoding, corrupt)
            sent = {**headers, **auth("low")}
            sent.pop("Transfer-Encoding", None)  # would change the framing of the test client
            if encoding:
                sent["Content-Encoding"] = encoding
            future = asyncio.run_coroutine_threadsafe(one(endpoint, data, sent), loop)
            future.result(timeout=30)

        async def one(endpoint: str, data: bytes, headers: dict[str, str]) -> None:
            resp = await client.post(endpoint, data=data, headers=headers)
            raw = await resp.read()
            STATUSES[resp.status] += 1
            assert resp.status < 500, (resp.status, raw[:300])
            if resp.status >= 300:
                assert_openai_error(resp.status, resp.content_type, raw)

        # Hypothesis drives synchronously: it runs in a thread, each case on the app's loop.
        await asyncio.to_thread(case)
        assert len(state.queue) == 0
        assert all(b.inflight == 0 for b in state.pool.all())
        assert state.limits.concurrent("tenant-low") == 0
    print(f"\nfuzz: {sum(STATUSES.values())} cases, statuses {dict(sorted(STATUSES.items()))}")
    assert sum(STATUSES.values()) >= FUZZ_CASES


# -- targeted ------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [64, 65, 300, 2000])
async def test_nesting_past_the_limit_is_a_400_before_any_backend(depth: int) -> None:
    async with proxy_app() as (client, _):
        # depth levels of content nesting under messages[0]: the body's own depth is depth + 3
        body = {"model": "tiny", "messages": [{"role": "user", "content": nested(depth)}]}
        data = encode(body) if depth < 250 else _deep_raw(depth)
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
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
        waited = asyncio.get_running_loop().time() - started
        writer.close()
        assert head.startswith(b"HTTP/1.1 408"), head
        assert b"application/json" in head
        assert 0.25 <= waited < 2.0


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


async def test_tpm_overage_makes_the_next_request_429_with_the_exact_retry_after(
    clock: FakeClock,
) -> None:
    backend = ScriptedBackend(usage=(1_000, 200))  # far past what the request reserved
    async with serve_scripted(backend) as url:
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
            # The bucket holds 600 - 1,200 = -600; the reservation refills at 10 tokens/s.
            assert second.headers["Retry-After"] == str(math.ceil((600 + need) / 10))
            assert r.state.limits.concurrent("tenant-normal") == 0
