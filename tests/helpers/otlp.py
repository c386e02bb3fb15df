"""An OTLP trace receiver for the tests, speaking the real wire format
(``opentelemetry-proto``): OTLP/gRPC (``TraceService/Export``, on a unix socket or a port) and
OTLP/HTTP with protobuf bodies (``POST /v1/traces``). Every span it is sent is kept, decoded,
with the ``service.name`` of its resource."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, cast

import grpc
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from proxy.bench.inproc import serve_app

ExportRequest = trace_service_pb2.ExportTraceServiceRequest
ExportResponse = trace_service_pb2.ExportTraceServiceResponse


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    via: str  # "grpc" | "http"
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_span_id: str  # "" for a root
    name: str
    kind: int  # the protobuf's: 2 SERVER, 3 CLIENT
    attributes: dict[str, Any]
    events: tuple[str, ...]
    start_ns: int
    end_ns: int


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs if isinstance(kv, KeyValue)}


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.exports = {"grpc": 0, "http": 0}

    def take(self, request: Any, via: str) -> None:
        self.exports[via] += 1
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        ReceivedSpan(
                            service=service,
                            via=via,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            name=span.name,
                            kind=span.kind,
                            attributes=_attributes(span.attributes),
                            events=tuple(e.name for e in span.events),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    # -- OTLP/gRPC -------------------------------------------------------------------------

    async def Export(self, request: Any, context: Any) -> Any:  # the proto names it
        self.take(request, "grpc")
        return ExportResponse()

    @contextlib.asynccontextmanager
    async def grpc_server(self, address: str) -> AsyncIterator[str]:
        """Serve OTLP/gRPC at ``address`` (``unix:///PATH`` or ``127.0.0.1:0``); yields the
        address bound."""
        server = grpc.aio.server()
        register = cast(  # generated code, untyped
            Callable[[Any, Any], None], trace_service_pb2_grpc.add_TraceServiceServicer_to_server
        )
        register(self, server)
        port = server.add_insecure_port(address)
        await server.start()
        try:
            yield address if address.startswith("unix:") else f"127.0.0.1:{port}"
        finally:
            await server.stop(grace=None)

    # -- OTLP/HTTP ---------------------------------------------------------------------------

    async def http_export(self, request: web.Request) -> web.Response:
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415)
        message = ExportRequest()
        message.ParseFromString(await request.read())
        self.take(message, "http")
        return web.Response(
            body=ExportResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    @contextlib.asynccontextmanager
    async def http_server(self) -> AsyncIterator[str]:
        """Serve OTLP/HTTP on a free loopback port; yields the traces URL."""
        app = web.Application()
        app.router.add_post("/v1/traces", self.http_export)
        async with serve_app(app) as url:
            yield url + "/v1/traces"
