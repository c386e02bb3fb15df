"""Hostile trace context against `tierproxy serve` with tracing on (docs/tracing.md): duplicate,
oversized, malformed and whitespace-padded ``traceparent``, a ``tracestate`` far past W3C's 32
members, a large ``baggage``. Every request is served, nothing is logged as a bug, the backend
never gets more than a well-formed context of the proxy's own, and the spans reach an OTLP/HTTP
receiver (the real wire format) when the served process stops (its shutdown flushes them)."""

from __future__ import annotations

import orjson
from aiohttp import web

from proxy.bench.hostile.kit import exchange, request_bytes
from proxy.bench.hostile.served import NullBackend, StartServed, ThreadedUpstream
from proxy.bench.inproc import KEYS
from tests.helpers.otlp import OtlpReceiver

BODY = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{SPAN}-01"
CASES: list[list[tuple[str, str]]] = [
    [("traceparent", VALID), ("traceparent", f"00-{'1' * 32}-{'2' * 16}-01")],  # two
    [("traceparent", "00-" + "f" * 6000)],
    [("traceparent", VALID), ("tracestate", ",".join(f"k{i}=v{i}" for i in range(600)))],
    [("traceparent", f"  {VALID}\t")],
    [("traceparent", VALID + "-extra-fields")],
    [("traceparent", "00-\u00ff\u00fe-\u00fd-01")],  # latin-1 bytes that are not hex
    [("traceparent", VALID), ("baggage", ",".join(f"b{i}=" + "x" * 50 for i in range(100)))],
]


def w3c_well_formed(traceparent: str, tracestate: str | None) -> bool:
    parts = traceparent.split("-")
    members = tracestate.split(",") if tracestate else []
    return (
        [len(p) for p in parts] == [2, 32, 16, 2]
        and all(c in "0123456789abcdef" for c in "".join(parts))
        and len(members) <= 32
    )


async def test_hostile_trace_context_is_served_and_bounded(
    start_served: StartServed, backend: NullBackend
) -> None:
    receiver = OtlpReceiver()
    app = web.Application()
    app.router.add_post("/v1/traces", receiver.http_export)
    with ThreadedUpstream(app) as sink:
        tracing = {"endpoint": f"{sink.url}/v1/traces", "protocol": "http/protobuf"}
        proxy = start_served(tracing=tracing)
        seen = len(backend.null.received)
        body = orjson.dumps(BODY)
        for case in CASES:
            headers = [
                ("Content-Type", "application/json"),
                ("Authorization", f"Bearer {KEYS['normal']}"),
                *case,
            ]
            resp = await exchange(
                proxy.host, proxy.port, request_bytes("POST", "/v1/chat/completions", headers, body)
            )
            assert resp.status == 200, (case[0][1][:40], resp.body[:200])
        proxy.stop()  # graceful: the spans still queued are exported now
        assert proxy.tracebacks() == 0, proxy.log_text()[-3000:]
    received = backend.null.received[seen:]
    assert len(received) == len(CASES)
    for got in received:
        assert got.headers.getall("traceparent") == [got.headers["traceparent"]]
        assert w3c_well_formed(got.headers["traceparent"], got.headers.get("tracestate"))
        assert not got.headers["traceparent"].startswith(f"00-{'1' * 32}")
    servers = [s for s in receiver.spans if s.name == "POST /v1/chat/completions"]
    assert len(servers) == len(CASES)
    # Continued: the first of the two (the one a header lookup reads), the padded one (W3C
    # allows the blanks), the valid ones beside an oversized tracestate (dropped: past 32
    # members) or baggage; the malformed ones start traces of their own.
    continued = [s for s in servers if s.trace_id == TRACE]
    assert len(continued) == 4
    assert all(s.parent_span_id == SPAN for s in continued)


async def _sampled_requests(proxy_host: str, port: int, count: int) -> None:
    headers = [
        ("Content-Type", "application/json"),
        ("Authorization", f"Bearer {KEYS['normal']}"),
        ("traceparent", VALID),
    ]
    for _ in range(count):
        resp = await exchange(
            proxy_host,
            port,
            request_bytes("POST", "/v1/chat/completions", headers, orjson.dumps(BODY)),
        )
        assert resp.status == 200, resp.body[:200]


async def test_a_tenant_cannot_make_the_proxy_record_its_requests(
    start_served: StartServed, backend: NullBackend
) -> None:
    """The operator pays for every span: at sample_ratio 0, a sampled traceparent records
    nothing by default (it recorded every request before issue 30), and with the opt-in
    follow_client_sampling at most client_sampled_per_minute of them."""
    for follow, expected in ((False, 0), (True, 3)):
        receiver = OtlpReceiver()
        app = web.Application()
        app.router.add_post("/v1/traces", receiver.http_export)
        with ThreadedUpstream(app) as sink:
            tracing = {
                "endpoint": f"{sink.url}/v1/traces",
                "protocol": "http/protobuf",
                "sample_ratio": 0.0,
                "follow_client_sampling": follow,
                "client_sampled_per_minute": 3,
            }
            proxy = start_served(tracing=tracing)
            await _sampled_requests(proxy.host, proxy.port, 20)
            proxy.stop()  # graceful: the spans still queued are exported now
            assert proxy.tracebacks() == 0, proxy.log_text()[-3000:]
        servers = [s for s in receiver.spans if s.name == "POST /v1/chat/completions"]
        assert len(servers) == expected, follow
