"""Every vLLM model route through the whole app, against an in-process backend shaped like vLLM:
the tiers, the path sent on, the headers of the answer, 405s and vLLM's probes."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from proxy.api.routes import POST_PATHS
from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import auth
from proxy.policies.tenants import VirtualTokenCounter
from proxy.relay import sse
from proxy.server.version import VERSION_TTL_S
from proxy.ticket import TICKET_HEADER
from tests.helpers.clock import FakeClock
from tests.helpers.routes_app import BODIES, LIMITED_KEY, proxy

USAGE = (5, 1)  # prompt, completion tokens the fake reports (a pooling answer: 5, 0)


def test_every_route_has_a_body_here() -> None:
    assert set(POST_PATHS) == set(BODIES)


@pytest.mark.parametrize("path", sorted(BODIES))
async def test_each_route_goes_through_the_tiers_to_the_same_path(
    clock: FakeClock, path: str
) -> None:
    backend = FakeVLLM(usage=USAGE)
    async with proxy(clock, backend) as (client, state):
        async with client.post(path, json=BODIES[path], headers=auth("high")) as resp:
            assert resp.status == 200, await resp.text()
            request_id = resp.headers["X-Request-Id"]
        [got] = backend.received
        assert got.path == path
        assert got.headers["X-Request-Id"] == request_id
        assert TICKET_HEADER in got.headers  # the plugin verifies every POST
        assert "priority" in got.body  # the tier's, sent as vLLM's own field
        assert state.dispatcher.pool.all()[0].inflight == 0  # the slot came back
        assert state.metrics.requests.labels("high", "ok")._value.get() == 1


async def test_wrong_method_is_405_with_allow(clock: FakeClock) -> None:
    async with proxy(clock, FakeVLLM(usage=USAGE)) as (client, _):
        for path in ("/v1/responses", "/pooling", "/tokenize", "/v1/chat/completions"):
            async with client.get(path, headers=auth("high")) as resp:
                assert resp.status == 405 and resp.headers["Allow"] == "POST"
                assert resp.headers["x-should-retry"] == "false"
                body = await resp.json()
                assert body["error"]["code"] == "method_not_allowed"


async def test_health_and_version_as_vllm_answers_them(clock: FakeClock) -> None:
    async with proxy(clock, FakeVLLM(usage=USAGE)) as (client, state):
        async with client.get("/health") as resp:  # no key, as with vLLM
            assert resp.status == 200 and await resp.read() == b""
        async with client.get("/version") as resp:
            assert resp.status == 200 and await resp.json() == {"version": "0.32.0"}
        state.pool.all()[0].healthy = False
        async with client.get("/health") as resp:
            assert resp.status == 503
        async with client.get("/version") as resp:  # from the cache
            assert resp.status == 200
        clock.advance(VERSION_TTL_S)
        async with client.get("/version") as resp:
            assert resp.status == 503


async def test_version_is_answered_from_a_cache_never_per_request(clock: FakeClock) -> None:
    """Unauthenticated, so a scanner may flood it: one backend call per cache period."""
    backend = FakeVLLM(usage=USAGE)
    async with proxy(clock, backend) as (client, _):

        async def one() -> int:
            async with client.get("/version") as resp:
                return resp.status

        assert await asyncio.gather(*(one() for _ in range(50))) == [200] * 50
        assert await one() == 200
        assert backend.version_calls == 1
        clock.advance(VERSION_TTL_S)
        assert await one() == 200 and backend.version_calls == 2


async def test_client_request_id_is_echoed_when_plain(clock: FakeClock) -> None:
    """Echoed to the client; vLLM always gets the proxy's own id (test_request_ids.py)."""
    backend = FakeVLLM(usage=USAGE)
    body = BODIES["/v1/embeddings"]
    async with proxy(clock, backend) as (client, _):
        mine = {**auth("high"), "X-Request-Id": "req-42.a:b"}
        async with client.post("/v1/embeddings", json=body, headers=mine) as resp:
            assert resp.headers["X-Request-Id"] == "req-42.a:b"
        odd = {**auth("high"), "X-Request-Id": "a b\tc" + "x" * 200}
        async with client.post("/v1/embeddings", json=body, headers=odd) as resp:
            replaced = resp.headers["X-Request-Id"]
            assert replaced != odd["X-Request-Id"] and len(replaced) == 32
        async with client.post("/v1/embeddings", json={}, headers=mine) as resp:
            assert resp.status == 400 and resp.headers["X-Request-Id"] == "req-42.a:b"
            assert resp.headers["x-should-retry"] == "false"
    sent = [r.headers["X-Request-Id"] for r in backend.received]
    assert len(sent) == 2 and "req-42.a:b" not in sent and all(len(s) == 32 for s in sent)
    assert sent[1] == replaced  # a malformed id: the answer carries the proxy's own


async def test_every_answer_carries_the_request_id(clock: FakeClock) -> None:
    backend = FakeVLLM(usage=USAGE)
    mine = {**auth("high"), "X-Request-Id": "stream-7"}
    body = {**BODIES["/v1/completions"], "stream": True}
    async with proxy(clock, backend) as (client, _):
        async with client.post("/v1/completions", json=body, headers=mine) as resp:
            assert resp.headers["Content-Type"] == "text/event-stream"
            assert resp.headers["X-Request-Id"] == "stream-7"
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        for method, path in (("GET", "/nowhere"), ("GET", "/tokenize"), ("GET", "/health")):
            async with client.request(method, path, headers=mine) as resp:
                assert resp.headers["X-Request-Id"] == "stream-7", path
    assert len(backend.received[0].headers["X-Request-Id"]) == 32  # the proxy's own


async def test_ratelimit_headers_for_a_tenant_with_limits(clock: FakeClock) -> None:
    body = BODIES["/v1/embeddings"]
    async with proxy(clock, FakeVLLM(usage=USAGE)) as (client, _):
        key = {"Authorization": f"Bearer {LIMITED_KEY}"}
        async with client.post("/v1/embeddings", json=body, headers=key) as resp:
            assert resp.status == 200
            h = resp.headers
            assert h["x-ratelimit-limit-requests"] == "60"
            assert h["x-ratelimit-remaining-requests"] == "59"
            assert h["x-ratelimit-reset-requests"] == "1s"
            assert h["x-ratelimit-limit-tokens"] == "6000"
            # The usage (5 tokens) was charged, the estimate given back.
            assert h["x-ratelimit-remaining-tokens"] == "5995"
            assert h["x-ratelimit-reset-tokens"] == "50ms"
        async with client.post("/v1/embeddings", json=body, headers=auth("high")) as resp:
            assert not any(name.startswith("x-ratelimit") for name in resp.headers)


async def test_responses_stream_relays_events_and_charges_usage(clock: FakeClock) -> None:
    body = {**BODIES["/v1/responses"], "stream": True}
    backend = FakeVLLM(usage=USAGE)
    async with proxy(clock, backend) as (client, state):
        async with client.post("/v1/responses", json=body, headers=auth("high")) as resp:
            assert resp.status == 200 and "X-Request-Id" in resp.headers
            raw = await resp.read()
        kinds = [line for line in raw.split(b"\n") if line.startswith(b"event:")]
        assert kinds[-1] == b"event: response.completed" and b"[DONE]" not in raw
        tokens = state.metrics.tokens
        assert tokens.labels("high", "prompt")._value.get() == USAGE[0]
        assert tokens.labels("high", "completion")._value.get() == USAGE[1]
        assert state.metrics.requests.labels("high", "ok")._value.get() == 1
    assert "stream_options" not in backend.received[0].body  # not a Responses API field


async def test_responses_stream_cut_before_its_end_gets_an_error_event(
    clock: FakeClock,
) -> None:
    body = {**BODIES["/v1/responses"], "stream": True}
    async with proxy(clock, FakeVLLM(usage=USAGE, cut_responses_stream=True)) as (client, state):
        async with client.post("/v1/responses", json=body, headers=auth("high")) as resp:
            events = [e async for e in sse.read_events(resp.content)]
        assert events[-1].startswith(b"event: error\n")
        data = sse.event_data(events[-1])
        assert data is not None and orjson.loads(data)["type"] == "error"
        assert state.metrics.requests.labels("high", "upstream_error")._value.get() == 1


async def test_tokenize_skips_the_queue(clock: FakeClock) -> None:
    """With the backend's every slot taken, a tokenize request still runs at once."""
    fake = FakeVLLM(usage=USAGE)
    async with proxy(clock, fake) as (client, state):
        backend = state.pool.all()[0]
        backend.inflight = int(backend.max_room)
        async with client.post("/tokenize", json=BODIES["/tokenize"], headers=auth("high")) as r:
            assert r.status == 200 and (await r.json())["count"] == 2
        assert backend.inflight == int(backend.max_room) and len(state.queue) == 0
        async with client.post("/tokenize", json=BODIES["/tokenize"]) as r:
            assert r.status == 401  # never without a key
        # Never queued, so nothing to correct: a refused one credits its tenant nothing.
        fairness = state.queue.fairness
        assert isinstance(fairness, VirtualTokenCounter)  # the default policy
        counter = fairness.counter("tenant-high")
        fake.tokenize_status = 400
        async with client.post("/tokenize", json=BODIES["/tokenize"], headers=auth("high")) as r:
            assert r.status == 400 and r.headers["x-should-retry"] == "false"
        assert fairness.counter("tenant-high") == counter
        state.pool.all()[0].healthy = False
        async with client.post("/tokenize", json=BODIES["/tokenize"], headers=auth("high")) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert fairness.counter("tenant-high") == counter


async def test_unknown_model_lists_the_served_names(clock: FakeClock) -> None:
    async with proxy(clock, FakeVLLM(usage=USAGE)) as (client, state):
        assert state.monitor is not None
        await state.monitor.probe_all()
        body = {**BODIES["/v1/embeddings"], "model": "nope"}
        async with client.post("/v1/embeddings", json=body, headers=auth("high")) as resp:
            assert resp.status == 404 and resp.headers["x-should-retry"] == "false"
            error = (await resp.json())["error"]
        assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
        assert error["message"] == "The model `nope` does not exist. Valid aliases: tiny."


async def test_max_tokens_as_a_string_is_read_as_vllm_reads_it(clock: FakeClock) -> None:
    backend = FakeVLLM(usage=USAGE)
    body = {**BODIES["/v1/completions"], "max_tokens": "4", "stream": "false", "n": None}
    async with proxy(clock, backend) as (client, _):
        resp = await client.post("/v1/completions", json=body, headers=auth("high"))
        assert resp.status == 200
    sent = backend.received[0].body
    assert sent["max_tokens"] == 4 and sent["stream"] is False and "n" not in sent
