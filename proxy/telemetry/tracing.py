"""OpenTelemetry tracing of requests (``tracing:``; docs/tracing.md): the provider, its sampler
and OTLP exporter, and the start of each request's spans (``proxy.telemetry.spans``).

Imported only when tracing is on (``proxy.server.state``): with it off the proxy never loads
OpenTelemetry and the pipeline makes no span object. The provider is the proxy's own, not the
process-global one. Spans go out through a batch processor: ending one appends to a queue; a
thread of the SDK encodes and exports them, off the event loop.

A client's ``traceparent``/``tracestate`` is continued (it becomes the server span's parent;
only with ``follow_client_sampling``, an opt-in, does its sampled flag record the request, and
then at most ``client_sampled_per_minute`` times per tenant and minute: the operator pays for
every span); a malformed one is ignored (a new trace starts). Nothing else reads it: no
tier, priority or limit depends on it, and ``baggage`` is never read.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import web
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy.config.tracing import TracingSettings
from proxy.telemetry.spans import RequestSpans


def sampler_for(settings: TracingSettings) -> Sampler:
    """Parent-based by trace-id ratio. A client's parent never lowers the ratio; with
    ``follow_client_sampling`` its sampled flag records the request (``Tracing.begin`` clears
    the flag once the tenant's allowance is spent), otherwise the ratio decides under it too
    (its trace id kept)."""
    ratio = TraceIdRatioBased(settings.sample_ratio)
    if settings.follow_client_sampling:
        return ParentBased(root=ratio, remote_parent_not_sampled=ratio)
    return ParentBased(root=ratio, remote_parent_sampled=ratio, remote_parent_not_sampled=ratio)


class ClientSampling:
    """How many requests per tenant and minute a client's sampled flag alone gets recorded
    (fixed one-minute windows on an injected clock: a bound, not a shaper)."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self._windows: dict[str, tuple[float, int]] = {}  # tenant -> (window start, used)

    def allow(self, tenant: str) -> bool:
        now = self.clock()
        start, used = self._windows.get(tenant, (now, 0))
        if now - start >= 60.0:
            start, used = now, 0
        if used >= self.per_minute:
            return False
        self._windows[tenant] = (start, used + 1)
        return True


def _client_sampled(parent: Context) -> bool:
    ctx = trace.get_current_span(parent).get_span_context()
    return ctx.is_valid and ctx.is_remote and ctx.trace_flags.sampled


def _unsampled(parent: Context) -> Context:
    """``parent`` with its remote span's sampled flag cleared (the ratio decides then)."""
    ctx = trace.get_current_span(parent).get_span_context()
    flags = TraceFlags(ctx.trace_flags & ~TraceFlags.SAMPLED)
    cleared = SpanContext(ctx.trace_id, ctx.span_id, True, flags, ctx.trace_state)
    return trace.set_span_in_context(NonRecordingSpan(cleared), parent)


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
        self,
        settings: TracingSettings,
        *,
        processor: SpanProcessor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``processor``: where spans go (tests: a simple processor into memory); default a
        batch processor into the OTLP exporter. ``clock``: of the client-sampling allowance."""
        self.follow = settings.follow_client_sampling
        self.client_sampling = ClientSampling(settings.client_sampled_per_minute, clock)
        resource = Resource.create({SERVICE_NAME: settings.service_name})
        self.provider = TracerProvider(resource=resource, sampler=sampler_for(settings))
        self.provider.add_span_processor(
            processor if processor is not None else BatchSpanProcessor(otlp_exporter(settings))
        )
        self.tracer = self.provider.get_tracer("tierproxy")
        self.propagator = TraceContextTextMapPropagator()

    def begin(
        self, request: web.BaseRequest, request_id: str, arrival: float, now: float, tenant: str
    ) -> RequestSpans:
        """The request's server span, from ``arrival`` (pipeline clock; ``now`` is the same
        clock's present), continuing the client's trace where its traceparent is valid."""
        offset_ns = time.time_ns() - int(now * 1e9)
        method, route = request.method, request.path  # a matched route: a bounded set
        parent = self.propagator.extract(request.headers)  # an invalid header: empty context
        if self.follow and _client_sampled(parent) and not self.client_sampling.allow(tenant):
            parent = _unsampled(parent)
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
