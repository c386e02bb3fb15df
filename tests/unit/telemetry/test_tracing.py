"""Tracing (proxy.telemetry.tracing, proxy.telemetry.spans) through the real pipeline against
fake vLLM backends, spans caught in memory, times on the fake clock (tests/helpers/rig.py)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import KEYS, SECRET, auth, make_config, until
from proxy.config import tracing as tracing_config
from proxy.config.loader import ConfigError, parse_config
from proxy.config.tracing import TracingSettings
from proxy.telemetry import spans as spans_module
from proxy.telemetry.tracing import ClientSampling, Tracing
from proxy.ticket import TICKET_HEADER, decode_ticket
from tests.helpers.clock import FakeClock
from tests.helpers.rig import Rig, served_rig, tenants

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
PROMPT = "the secret prompt text 7f3a"


class Caught:
    """The spans the proxy ended, by name."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()

    def all(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.all() if s.name == name]

    def one(self, name: str) -> ReadableSpan:
        (span,) = self.named(name)
        return span


@contextlib.asynccontextmanager
async def traced(
    clock: FakeClock,
    *backends: FakeVLLM,
    ratio: float = 1.0,
    follow: bool = False,
    per_minute: int = 60,
    **config: Any,
) -> AsyncIterator[tuple[Rig, Caught]]:
    """The rig with tracing on (as ``tracing:`` builds it), its spans caught in memory."""
    caught = Caught()
    settings = TracingSettings(
        endpoint="http://127.0.0.1:9",
        sample_ratio=ratio,
        follow_client_sampling=follow,
        client_sampled_per_minute=per_minute,
    )
    tracing = Tracing(settings, processor=SimpleSpanProcessor(caught.exporter), clock=clock)
    async with served_rig(clock, *backends, **config) as r:
        r.state.pipeline.tracing = tracing
        try:
            yield r, caught
        finally:
            tracing.shutdown()


def hexid(value: int, width: int) -> str:
    return f"{value:0{width}x}"


def parent_id(span: ReadableSpan) -> str | None:
    return hexid(span.parent.span_id, 16) if span.parent is not None else None


def traceparent_of(span: ReadableSpan) -> str:
    """The traceparent naming ``span`` as the parent, sampled (W3C level 2 adds the
    random-trace-id flag to new traces: 03 rather than 01)."""
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{hexid(ctx.trace_id, 32)}-{hexid(ctx.span_id, 16)}-{ctx.trace_flags:02x}"


def sampled(traceparent: str) -> bool:
    return bool(int(traceparent.rsplit("-", 1)[1], 16) & 1)


def seconds(span: ReadableSpan) -> float:
    assert span.start_time is not None and span.end_time is not None
    return (span.end_time - span.start_time) / 1e9


# -- one request's spans ---------------------------------------------------------------------


async def test_a_stream_makes_the_server_span_and_one_child_per_step(clock: FakeClock) -> None:
    backend = FakeVLLM()
    async with traced(clock, backend) as (r, caught):
        resp = await r.chat(stream=True)
        assert resp.status == 200
        server = caught.one("POST /v1/chat/completions")
        assert server.kind == SpanKind.SERVER and server.parent is None
        attrs = dict(server.attributes or {})
        assert attrs["tierproxy.tenant"] == "tenant-normal"
        assert attrs["tierproxy.tier"] == "normal"
        assert attrs["http.route"] == "/v1/chat/completions"
        assert attrs["tierproxy.outcome"] == "ok"
        assert attrs["http.response.status_code"] == 200
        queue = caught.one("tierproxy.queue_wait")
        assert queue.attributes == {
            "tierproxy.tier": "normal",
            "tierproxy.queue.position": 1,
            "tierproxy.attempt": 1,
        }
        dispatch = caught.one("tierproxy.dispatch")
        assert dispatch.attributes is not None
        assert dispatch.attributes["tierproxy.backend"] == r.urls[0]
        assert dispatch.attributes["tierproxy.backend.inflight"] == 1
        assert "tierproxy.backend.room" in dispatch.attributes
        upstream = caught.one("tierproxy.upstream")
        assert upstream.kind == SpanKind.CLIENT
        assert upstream.attributes is not None
        assert upstream.attributes["http.response.status_code"] == 200
        assert upstream.attributes["url.path"] == "/v1/chat/completions"
        assert [e.name for e in upstream.events] == ["first_token"]
        relay = caught.one("tierproxy.relay")
        trace_id = server.context.trace_id
        for child in (queue, dispatch, upstream, relay):
            assert child.context.trace_id == trace_id
            assert parent_id(child) == hexid(server.context.span_id, 16)
        assert len(caught.all()) == 5
        # vLLM's spans join the trace under the upstream span, flagged sampled.
        (received,) = backend.received
        assert received.headers["traceparent"] == traceparent_of(upstream)
        assert sampled(received.headers["traceparent"])


async def test_the_queue_wait_is_its_own_span_as_long_as_the_wait(clock: FakeClock) -> None:
    backend = FakeVLLM()
    async with traced(clock, backend, backend={"max_inflight": 1}) as (r, caught):
        backend.gate.clear()
        first = asyncio.create_task(r.chat())
        await until(lambda: backend.active == 1, 5, "the first request at the backend")
        second = asyncio.create_task(r.chat("low"))
        await until(lambda: len(r.state.queue) == 1, 5, "the second request queued")
        third = asyncio.create_task(r.chat("low"))
        await until(lambda: len(r.state.queue) == 2, 5, "the third request queued")
        clock.advance(3.0)
        backend.gate.set()
        for task in (first, second, third):
            assert (await task).status == 200
        waits = sorted(caught.named("tierproxy.queue_wait"), key=lambda s: s.start_time or 0)
        assert [dict(s.attributes or {})["tierproxy.queue.position"] for s in waits] == [1, 1, 2]
        assert seconds(waits[0]) == 0.0  # the backend had room
        assert seconds(waits[1]) == pytest.approx(3.0)  # until the first one's slot freed


async def test_a_tenant_limit_wait_is_a_span_of_the_wait(clock: FakeClock) -> None:
    backend = FakeVLLM()
    limited = tenants(requests_per_minute=1, on_limit="queue")
    async with traced(clock, backend, tenants=limited) as (r, caught):
        assert (await r.chat()).status == 200
        assert caught.named("tierproxy.limit_wait") == []  # the first one did not wait
        assert (await r.chat()).status == 200
        wait = caught.one("tierproxy.limit_wait")
        assert dict(wait.attributes or {}) == {
            "tierproxy.limit": "requests_per_minute",
            "tierproxy.limit.waits": 1,
        }
        assert seconds(wait) == pytest.approx(60.0)  # the fake clock's sleep


async def test_a_retry_ends_the_failed_upstream_span_as_an_error(clock: FakeClock) -> None:
    overloaded, fine = FakeVLLM(status=503), FakeVLLM()
    async with traced(clock, overloaded, fine) as (r, caught):
        # Two tries on the overloaded one at most (max_attempts 3): send until one retried.
        for _ in range(4):
            assert (await r.chat()).status == 200
            if len(caught.named("tierproxy.upstream")) > len(caught.named("tierproxy.relay")):
                break
        failed = [
            s
            for s in caught.named("tierproxy.upstream")
            if s.status.status_code == StatusCode.ERROR
        ]
        assert failed and failed[0].status.description == "backend unavailable; retried"
        attempts = {
            dict(s.attributes or {})["tierproxy.attempt"]
            for s in caught.named("tierproxy.queue_wait")
        }
        assert 2 in attempts


async def test_a_refused_request_ends_its_server_span_with_the_refusal(clock: FakeClock) -> None:
    async with traced(clock, FakeVLLM()) as (r, caught):
        resp = await r.client.post(
            "/v1/chat/completions", json={"model": "tiny"}, headers=auth("normal")
        )
        assert resp.status == 400
        (server,) = caught.all()
        attrs = dict(server.attributes or {})
        assert attrs["tierproxy.outcome"] == "rejected"
        assert attrs["http.response.status_code"] == 400
        assert attrs["tierproxy.tenant"] == "tenant-normal"


async def test_a_keyless_request_records_no_span_whatever_its_traceparent(
    clock: FakeClock,
) -> None:
    """Fresh eyes (round 3, tr01): keyless requests with a sampled traceparent were recorded
    under the client's trace id, 50 of 50 at sample_ratio 0: anonymous traffic could fill the
    export queue and push out the tenants' spans."""
    async with traced(clock, FakeVLLM()) as (r, caught):
        headers = {
            "Authorization": "Bearer no",
            "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
        }
        for _ in range(3):
            resp = await r.client.post("/v1/chat/completions", json=body(), headers=headers)
            assert resp.status == 401
        assert caught.all() == []


# -- the client's trace context ---------------------------------------------------------------


async def test_a_client_traceparent_is_continued_and_its_tracestate_kept(
    clock: FakeClock,
) -> None:
    backend = FakeVLLM()
    async with traced(clock, backend) as (r, caught):
        headers = {
            **auth("normal"),
            "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
            "tracestate": "vendor=abc",
        }
        resp = await r.client.post("/v1/chat/completions", json=body(), headers=headers)
        assert resp.status == 200
        server = caught.one("POST /v1/chat/completions")
        assert hexid(server.context.trace_id, 32) == CLIENT_TRACE
        assert parent_id(server) == CLIENT_SPAN
        upstream = caught.one("tierproxy.upstream")
        (received,) = backend.received
        # vLLM's parent is the proxy's upstream span, not the client's span.
        assert received.headers["traceparent"] == traceparent_of(upstream)
        assert received.headers.getall("traceparent") == [traceparent_of(upstream)]
        assert received.headers["tracestate"] == "vendor=abc"


@pytest.mark.parametrize(
    "traceparent",
    [
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
        f"00-{CLIENT_TRACE}-0000000000000000-01",  # all-zero span id
        f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01",  # the forbidden version
        f"00-{CLIENT_TRACE.upper()}-{CLIENT_SPAN}-01",  # upper case
        f"00-{CLIENT_TRACE}-{CLIENT_SPAN}",  # no flags
        "garbage",
        "00-" + "a" * 5000,
    ],
)
async def test_a_malformed_traceparent_is_ignored(clock: FakeClock, traceparent: str) -> None:
    backend = FakeVLLM()
    async with traced(clock, backend) as (r, caught):
        headers = {**auth("normal"), "traceparent": traceparent, "tracestate": "vendor=abc"}
        resp = await r.client.post("/v1/chat/completions", json=body(), headers=headers)
        assert resp.status == 200
        server = caught.one("POST /v1/chat/completions")
        assert server.parent is None  # a new trace
        assert hexid(server.context.trace_id, 32) != CLIENT_TRACE
        (received,) = backend.received
        assert received.headers["traceparent"] == traceparent_of(caught.one("tierproxy.upstream"))
        assert "tracestate" not in received.headers  # belonged to the ignored parent


async def test_a_client_trace_context_decides_nothing_else(clock: FakeClock) -> None:
    """A low-tier tenant's traceparent, tracestate and baggage that name another tier and a
    priority change neither its ticket nor its body."""
    backend = FakeVLLM()
    async with traced(clock, backend) as (r, caught):
        headers = {
            **auth("low"),
            "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
            "tracestate": "tier=high,priority=0",
            "baggage": "tierproxy.tier=high,priority=0,tenant=tenant-high",
        }
        resp = await r.client.post("/v1/chat/completions", json=body(), headers=headers)
        assert resp.status == 200
        (received,) = backend.received
        ticket = decode_ticket(received.headers[TICKET_HEADER], SECRET)
        assert (ticket.tier, ticket.tenant, ticket.priority) == ("low", "tenant-low", 10)
        server = caught.one("POST /v1/chat/completions")
        attrs = dict(server.attributes or {})
        assert (attrs["tierproxy.tier"], attrs["tierproxy.tenant"]) == ("low", "tenant-low")


# -- sampling --------------------------------------------------------------------------------


async def test_sampling_off_records_nothing_and_tells_vllm_not_to(clock: FakeClock) -> None:
    backend = FakeVLLM()
    async with traced(clock, backend, ratio=0.0) as (r, caught):
        for _ in range(3):
            assert (await r.chat(stream=True)).status == 200
        assert caught.all() == []
        for received in backend.received:
            assert not sampled(received.headers["traceparent"])


async def test_a_client_not_sampled_flag_never_lowers_the_ratio(clock: FakeClock) -> None:
    for follow in (False, True):
        backend = FakeVLLM()
        async with traced(clock, backend, ratio=1.0, follow=follow) as (r, caught):
            headers = {**auth("normal"), "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"}
            resp = await r.client.post("/v1/chat/completions", json=body(), headers=headers)
            assert resp.status == 200
            server = caught.one("POST /v1/chat/completions")
            assert hexid(server.context.trace_id, 32) == CLIENT_TRACE  # continued all the same
            (received,) = backend.received
            assert sampled(received.headers["traceparent"])


async def _client_sampled_requests(r: Rig, count: int, tier: str = "normal") -> None:
    headers = {**auth(tier), "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    for _ in range(count):
        resp = await r.client.post("/v1/chat/completions", json=body(), headers=headers)
        assert resp.status == 200


async def test_by_default_a_client_cannot_make_the_proxy_record_its_requests(
    clock: FakeClock,
) -> None:
    backend = FakeVLLM()
    async with traced(clock, backend, ratio=0.0) as (r, caught):
        await _client_sampled_requests(r, 5)
        assert caught.all() == []
        assert not any(sampled(got.headers["traceparent"]) for got in backend.received)


async def test_followed_client_sampling_is_bounded_per_tenant_and_minute(
    clock: FakeClock,
) -> None:
    backend = FakeVLLM()
    async with traced(clock, backend, ratio=0.0, follow=True, per_minute=3) as (r, caught):
        await _client_sampled_requests(r, 5)
        assert len(caught.named("POST /v1/chat/completions")) == 3
        await _client_sampled_requests(r, 2, tier="high")  # another tenant's own allowance
        assert len(caught.named("POST /v1/chat/completions")) == 5
        clock.advance(60.0)
        await _client_sampled_requests(r, 5)
        assert len(caught.named("POST /v1/chat/completions")) == 8


def test_client_sampling_allowance_windows() -> None:
    clock = FakeClock()
    allowance = ClientSampling(2, clock)
    assert [allowance.allow("a") for _ in range(3)] == [True, True, False]
    assert allowance.allow("b")
    clock.advance(59.9)
    assert not allowance.allow("a")
    clock.advance(0.1)
    assert allowance.allow("a")
    assert not ClientSampling(0, clock).allow("a")


async def test_tracing_off_makes_no_span_object(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[object] = []
    real_init = spans_module.RequestSpans.__init__

    def counting_init(self: spans_module.RequestSpans, *args: Any) -> None:
        made.append(self)
        real_init(self, *args)

    monkeypatch.setattr(spans_module.RequestSpans, "__init__", counting_init)
    backend = FakeVLLM()
    async with served_rig(clock, backend) as r:
        assert r.state.tracing is None and r.state.pipeline.tracing is None
        headers = {**auth("normal"), "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
        resp = await r.client.post("/v1/chat/completions", json=body(), headers=headers)
        assert resp.status == 200
        assert made == []
        # Off, the proxy is transparent to a client's trace context: vLLM continues it.
        (received,) = backend.received
        assert received.headers["traceparent"] == f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def test_tracing_off_never_loads_the_tracer() -> None:
    """The proxy's state with tracing off, built in a fresh interpreter: neither the proxy's
    tracing modules nor OpenTelemetry's trace SDK is loaded (with tracing on, both are).
    (The redis client loads OpenTelemetry's API for its own metrics where it is installed.)"""
    code = """
import sys, time, yaml
from proxy.bench.inproc import SECRET, make_config
from proxy.config.loader import parse_config
import proxy.server.app
from proxy.server.state import ProxyState
cfg = make_config([{"url": "http://127.0.0.1:9"}], **EXTRA)
state = ProxyState(parse_config(yaml.safe_dump(cfg), "t"), SECRET, time.monotonic)
watched = ("proxy.telemetry.tracing", "proxy.telemetry.spans", "opentelemetry.sdk.trace")
print(sorted(m for m in sys.modules if m in watched))
"""
    loaded = []
    for extra in ("{}", '{"tracing": {"endpoint": "http://127.0.0.1:9"}}'):
        out = subprocess.run(
            [sys.executable, "-c", code.replace("EXTRA", extra)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        loaded.append(out.stdout.strip().splitlines()[-1])
    assert loaded[0] == "[]"
    assert loaded[1] == str(
        ["opentelemetry.sdk.trace", "proxy.telemetry.spans", "proxy.telemetry.tracing"]
    )


# -- what the spans carry --------------------------------------------------------------------


async def test_no_span_carries_a_key_the_prompt_or_the_answer(clock: FakeClock) -> None:
    backend = FakeVLLM()
    async with traced(clock, backend) as (r, caught):
        for stream in (False, True):
            resp = await r.client.post(
                "/v1/chat/completions", json=body(stream=stream), headers=auth("normal")
            )
            assert resp.status == 200
            await resp.read()
        spans = caught.all()
        assert len(spans) == 10
        text = repr(
            [
                (
                    s.name,
                    s.attributes,
                    [(e.name, e.attributes) for e in s.events],
                    s.resource.attributes,
                )
                for s in spans
            ]
        )
        assert "tenant-normal" in text  # the check sees attributes at all
        for secret in (KEYS["normal"], "Bearer", PROMPT, "secret prompt", "hello"):
            assert secret not in text


# -- config ----------------------------------------------------------------------------------


def test_tracing_on_without_its_packages_is_refused_at_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tracing_config, "_importable", lambda module: "grpc" not in module)
    cfg = make_config([{"url": "http://127.0.0.1:9"}], tracing={"endpoint": "http://x:4317"})
    with pytest.raises(ConfigError) as err:
        parse_config(yaml.safe_dump(cfg), "test")
    assert "vllm-tierproxy[tracing]" in str(err.value)
    # The other protocol's exporter is there: that config loads.
    cfg["tracing"]["protocol"] = "http/protobuf"
    assert parse_config(yaml.safe_dump(cfg), "test").config.tracing is not None


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 8,
        **extra,
    }
