"""One request's spans (made by ``proxy.telemetry.tracing.Tracing.begin``; docs/tracing.md).

The pipeline reports steps, this turns them into spans under the request's SERVER span:

    limit_wait  → queue_wait → dispatch → upstream (first_token event) → relay

One step span is open at a time: the next step ends it (a retry's queue wait ends the failed
upstream span as an error), the request's end ends whatever is still open. Times come from the
pipeline's clock (its loop time, or a test's fake one), mapped once onto the epoch nanoseconds
OpenTelemetry wants. A request the sampler dropped keeps a non-recording server span (its
context still goes to vLLM, flagged not sampled) and makes no other span.

Attributes name the tenant, tier, route, backend and counts; never a key, a header's value or
any text of the request or answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context

from proxy.relay.forward import RelayResult

LIMIT_WAIT = "tierproxy.limit_wait"
QUEUE_WAIT = "tierproxy.queue_wait"
DISPATCH = "tierproxy.dispatch"
UPSTREAM = "tierproxy.upstream"
RELAY = "tierproxy.relay"
FIRST_TOKEN = "first_token"


class RequestSpans:
    __slots__ = (
        "_limit_waits",
        "_offset_ns",
        "_parent",
        "_propagator",
        "_step",
        "_tracer",
        "recording",
        "server",
    )

    def __init__(
        self, tracer: Tracer, propagator: TextMapPropagator, server: Span, offset_ns: int
    ) -> None:
        self._tracer = tracer
        self._propagator = propagator
        self.server = server
        self.recording = server.is_recording()
        # The parent of every step span (none where it was not sampled: no step span is made).
        self._parent = set_span_in_context(server) if self.recording else None
        self._offset_ns = offset_ns  # epoch ns minus the pipeline clock's ns
        self._step: Span | None = None  # the step span open now
        self._limit_waits = 0

    def ns(self, t: float) -> int:
        """Epoch nanoseconds of the pipeline clock's time ``t``."""
        return int(t * 1e9) + self._offset_ns

    def _child(
        self,
        name: str,
        start: float,
        attributes: Mapping[str, Any],
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> Span:
        return self._tracer.start_span(
            name,
            context=self._parent,
            kind=kind,
            attributes=attributes,
            start_time=self.ns(start),
        )

    def _end_step(self, at: float, error: str | None = None) -> None:
        step, self._step = self._step, None
        if step is not None:
            if error is not None:
                step.set_status(Status(StatusCode.ERROR, error))
            step.end(self.ns(at))

    # -- the steps, in request order ------------------------------------------------------

    def limit_wait(self, limit: str, now: float) -> None:
        """The tenant's limit made the request wait (again): one span from the first wait
        until it passes (the queue wait starts) or is refused (the request ends)."""
        if not self.recording:
            return
        self._limit_waits += 1
        if self._limit_waits == 1:
            self._step = self._child(LIMIT_WAIT, now, {"tierproxy.limit": limit})
        elif self._step is not None:
            self._step.set_attribute("tierproxy.limit", limit)
        if self._step is not None:
            self._step.set_attribute("tierproxy.limit.waits", self._limit_waits)

    def queue_wait(self, tier: str, ahead: int, attempts: int, now: float) -> None:
        """Into the tier's queue with ``ahead`` requests of the tier waiting there, after
        ``attempts`` backends failed it (a retry: the failed upstream span ends as an error)."""
        if not self.recording:
            return
        self._end_step(now, "backend unavailable; retried" if attempts else None)
        attributes = {
            "tierproxy.tier": tier,
            "tierproxy.queue.position": ahead + 1,
            "tierproxy.attempt": attempts + 1,
        }
        self._step = self._child(QUEUE_WAIT, now, attributes)

    def upstream(
        self,
        *,
        backend: str,
        address: str,
        room: float | None,
        inflight: int,
        granted_at: float,
        path: str,
        now: float,
    ) -> dict[str, str]:
        """The backend granted at ``granted_at`` (the queue wait ends there, the dispatch span
        runs from there to now) and the upstream call starting now; returns the W3C headers
        that make vLLM's spans children of the upstream span."""
        if not self.recording:
            return self._headers(self.server)  # the not-sampled flag goes on to vLLM
        self._end_step(granted_at)
        dispatch: dict[str, Any] = {
            "tierproxy.backend": backend,
            "tierproxy.backend.inflight": inflight,
        }
        if room is not None:
            dispatch["tierproxy.backend.room"] = room
        self._child(DISPATCH, granted_at, dispatch).end(self.ns(max(now, granted_at)))
        host, _, port = address.rpartition(":")
        attributes: dict[str, Any] = {
            "http.request.method": "POST",
            "url.path": path,
            "server.address": host or address,
            "tierproxy.backend": backend,
        }
        if port.isdigit():
            attributes["server.port"] = int(port)
        self._step = self._child(UPSTREAM, now, attributes, SpanKind.CLIENT)
        return self._headers(self._step)

    def upstream_done(self, result: RelayResult, now: float) -> None:
        """The backend's answer was relayed (a stream: from its first event to now, the relay
        span) or is held to be written (a buffered answer: the relay span runs on until the
        request ends)."""
        span = self._step
        if not self.recording or span is None:
            return
        self._step = None
        status, first_token_at, usage = result.status, result.first_token_at, result.usage
        span.set_attribute("http.response.status_code", status)
        if first_token_at is not None:
            span.add_event(FIRST_TOKEN, timestamp=self.ns(first_token_at))
        if usage is not None:
            for key, name in (("prompt_tokens", "input"), ("completion_tokens", "output")):
                value = usage.get(key)
                if isinstance(value, int) and not isinstance(value, bool):
                    span.set_attribute(f"gen_ai.usage.{name}_tokens", value)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end(self.ns(now))
        if first_token_at is not None:
            self._child(RELAY, first_token_at, {}).end(self.ns(now))
        else:
            self._step = self._child(RELAY, now, {})

    def end(
        self, tenant: str | None, tier: str | None, outcome: str, status: int, now: float
    ) -> None:
        """The request's end: the open step ends, the server span gets its labels."""
        if self.recording:
            self._end_step(now, None if outcome == "ok" else outcome)
            server = self.server
            labels: dict[str, Any] = {
                "tierproxy.outcome": outcome,
                "http.response.status_code": status,
            }
            if tenant is not None:
                labels["tierproxy.tenant"] = tenant
            if tier is not None:
                labels["tierproxy.tier"] = tier
            server.set_attributes(labels)
            if status >= 500:
                server.set_status(Status(StatusCode.ERROR, outcome))
        self.server.end(self.ns(now))

    def _headers(self, span: Span) -> dict[str, str]:
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(span))
        return carrier
