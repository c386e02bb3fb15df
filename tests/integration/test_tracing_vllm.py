"""One request, one trace across the proxy and real vLLM (docs/tracing.md): the proxy exports
its spans (OTLP/HTTP, or OTLP/gRPC) and vLLM its own (`--otlp-traces-endpoint`, OTLP/gRPC) to
the test's receiver (tests/helpers/otlp.py, the real wire format); vLLM's request span shares
the trace id and hangs under the proxy's upstream span."""

from __future__ import annotations

import contextlib
from typing import Any

import aiohttp
import pytest

from proxy.bench.inproc import auth, make_config, running_proxy, until
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import OTLP_SOCKET, TRACED
from tests.helpers.otlp import OtlpReceiver, ReceivedSpan

pytestmark = [pytest.mark.integration, pytest.mark.engines(TRACED)]
TIMEOUT = aiohttp.ClientTimeout(total=60)
SERVER, CLIENT = 2, 3  # the protobuf's SpanKind
PROXY_STEPS = {
    "tierproxy.queue_wait",
    "tierproxy.dispatch",
    "tierproxy.upstream",
    "tierproxy.relay",
}
CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


@contextlib.asynccontextmanager
async def receiver_for_vllm() -> Any:
    OTLP_SOCKET.unlink(missing_ok=True)
    receiver = OtlpReceiver()
    try:
        async with receiver.grpc_server(f"unix://{OTLP_SOCKET}"):
            yield receiver
    finally:
        OTLP_SOCKET.unlink(missing_ok=True)


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, spans)
    return found[0]


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
async def test_one_request_is_one_trace_across_the_proxy_and_vllm(
    engines: EngineFarm, protocol: str
) -> None:
    engine = engines.get(TRACED)
    async with receiver_for_vllm() as receiver, contextlib.AsyncExitStack() as stack:
        if protocol == "grpc":
            address = await stack.enter_async_context(receiver.grpc_server("127.0.0.1:0"))
            endpoint = f"http://{address}"
        else:
            endpoint = await stack.enter_async_context(receiver.http_server())
        tracing = {"endpoint": endpoint, "protocol": protocol, "sample_ratio": 1.0}
        config = make_config([{"url": engine.spec.url}], tracing=tracing)
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {**auth("normal"), "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
        async with (
            running_proxy(config) as (base, _),
            aiohttp.ClientSession(timeout=TIMEOUT) as session,
            session.post(f"{base}/v1/chat/completions", json=body, headers=headers) as resp,
        ):
            assert resp.status == 200
            assert b"[DONE]" in await resp.read()
        # The proxy flushed its spans as it stopped; vLLM exports every 100 ms.
        await until(
            lambda: any(s.service != "tierproxy" for s in receiver.trace(CLIENT_TRACE)),
            30,
            "vLLM's span of the request at the receiver",
        )
    spans = receiver.trace(CLIENT_TRACE)
    proxy = [s for s in spans if s.service == "tierproxy"]
    vllm = [s for s in spans if s.service != "tierproxy"]
    assert {s.via for s in proxy} == {"http" if protocol == "http/protobuf" else "grpc"}
    assert {s.via for s in vllm} == {"grpc"}
    # The proxy's spans: its server span continues the client's, one child per step.
    server = one(proxy, "POST /v1/chat/completions")
    assert server.kind == SERVER and server.parent_span_id == CLIENT_SPAN
    assert server.attributes["tierproxy.tenant"] == "tenant-normal"
    assert server.attributes["tierproxy.outcome"] == "ok"
    assert {s.name for s in proxy} == {server.name, *PROXY_STEPS}
    assert all(s.parent_span_id == server.span_id for s in proxy if s is not server)
    queue = one(proxy, "tierproxy.queue_wait")
    assert queue.attributes["tierproxy.tier"] == "normal"
    assert queue.attributes["tierproxy.queue.position"] == 1
    upstream = one(proxy, "tierproxy.upstream")
    assert upstream.kind == CLIENT and upstream.events == ("first_token",)
    assert upstream.attributes["gen_ai.usage.output_tokens"] == 8
    # vLLM's request span: in the same trace, under the proxy's upstream span, inside it.
    request = one(vllm, "llm_request")
    assert request.parent_span_id == upstream.span_id
    assert request.attributes["gen_ai.usage.completion_tokens"] == 8
    # vLLM's request id is made from the X-Request-Id the proxy sent: the two sides join on it.
    assert server.attributes["tierproxy.request_id"] in request.attributes["gen_ai.request.id"]
    # (two processes, one clock: a few ms of slack for the mapping of the proxy's loop time)
    assert upstream.start_ns - 5e6 <= request.start_ns <= request.end_ns <= upstream.end_ns + 5e6
