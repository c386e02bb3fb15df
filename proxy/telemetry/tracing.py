"""OpenTelemetry tracing of requests (``tracing:``; docs/tracing.md): the provider, its sampler
and OTLP exporter, and the start of each request's spans (``proxy.telemetry.spans``).

Imported only when tracing is on (``proxy.server.state``): with it off the proxy never loads
OpenTelemetry and the pipeline makes no span object. The provider is the proxy's own, not the
process-global one. Spans go out through a batch processor: ending one appends to a queue; a
thread of the SDK encodes and exports them, off the event loop.

A client's ``traceparent``/``tracestate`` is continued (it becomes the server span's parent,
and with ``follow_client_sampling`` its sampled flag is obeyed); a malformed one is ignored (a
new trace starts). Nothing else reads it: no tier, priority or limit depends on it, and
``baggage`` is never read.
"""

from __future__ import annotations

import time

from aiohttp import web
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy.config.tracing import TracingSettings
from proxy.telemetry.spans import RequestSpans


def sampler_for(settings: TracingSettings) -> Sampler:
    """Parent-based by trace-id ratio; with ``follow_client_sampling`` off, the ratio decides
    under a client's parent too (its flag is ignored, its trace id kept)."""
    ratio = TraceIdRatioBased(settings.sample_ratio)
    if settings.follow_client_sampling:
        return ParentBased(root=ratio)
    return ParentBased(root=ratio, remote_parent_sampled=ratio, remote_parent_not_sampled=ratio)


def otlp_exporter(settings: TracingSettings) -> SpanExporter:
    """The OTLP exporter of the configured protocol (the packages were checked at load)."""
    timeout = settings.export_timeout_s
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        # http:// and unix:// are plaintext; the exporter takes TLS from https:// itself.
        insecure = not settings.endpoint.startswith("https://")
        return GrpcExporter(endpoint=settings.endpoint, insecure=insecure, timeout=timeout)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=settings.endpoint, timeout=timeout)


class Tracing:
    def __init__(
        self, settings: TracingSettings, *, processor: SpanProcessor | None = None
    ) -> None:
        """``processor``: where spans go (tests: a simple processor into memory); default a
        batch processor into the OTLP exporter."""
        resource = Resource.create({SERVICE_NAME: settings.service_name})
        self.provider = TracerProvider(resource=resource, sampler=sampler_for(settings))
        self.provider.add_span_processor(
            processor if processor is not None else BatchSpanProcessor(otlp_exporter(settings))
        )
        self.tracer = self.provider.get_tracer("tierproxy")
        self.propagator = TraceContextTextMapPropagator()

    def begin(
        self, request: web.BaseRequest, request_id: str, arrival: float, now: float
    ) -> RequestSpans:
        """The request's server span, from ``arrival`` (pipeline clock; ``now`` is the same
        clock's present), continuing the client's trace where its traceparent is valid."""
        offset_ns = time.time_ns() - int(now * 1e9)
        method, route = request.method, request.path  # a matched route: a bounded set
        parent = self.propagator.extract(request.headers)  # an invalid header: empty context
        server = self.tracer.start_span(
            f"{method} {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": method,
                "http.route": route,
                "tierproxy.request_id": request_id,
            },
            start_time=int(arrival * 1e9) + offset_ns,
        )
        return RequestSpans(self.tracer, self.propagator, server, offset_ns)

    def shutdown(self) -> None:
        """Flush what is queued (within the export timeout) and stop the export thread."""
        self.provider.shutdown()
