"""What every request ends with, whatever happened to it: its answer's headers (request id,
``x-ratelimit-*``, ``x-should-retry``), a buffered answer's bounded write, its metrics and
goodput, and one access-log line."""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web

from proxy.api.errors import ProxyError
from proxy.api.hotpath import LabelCache
from proxy.api.outcome import Outcome, outcome_of
from proxy.api.reply_headers import ratelimit_headers, should_retry_header
from proxy.config.schema import LoadedConfig
from proxy.config.server import Relay as RelayBounds
from proxy.relay.clientsend import ClientStalled
from proxy.relay.held import HeldResponse
from proxy.relay.result import RelayResult
from proxy.relay.upstreamio import CLIENT_LEFT
from proxy.request.admitted import Trace
from proxy.scheduling.limits import TenantLimits
from proxy.telemetry.metrics import ProxyMetrics
from proxy.telemetry.slo import Latency

access_log = logging.getLogger("tierproxy.access")


class Answers:
    def __init__(
        self,
        *,
        config: Callable[[], LoadedConfig],
        clock: Callable[[], float],
        limits: TenantLimits,
        metrics: ProxyMetrics,
        child: LabelCache,
    ) -> None:
        self.config, self.clock, self.limits = config, clock, limits
        self.metrics, self.child = metrics, child

    def respond(self, trace: Trace, result: RelayResult) -> web.StreamResponse:
        trace.outcome, trace.status = result.outcome, result.status
        resp = result.response
        if not resp.prepared:  # a stream's headers went out with its first event
            resp.headers.setdefault("X-Request-Id", trace.reply_id)
            resp.headers.update(self.limit_headers(trace))
            resp.headers.update(should_retry_header(result.status))
        return resp

    async def deliver(
        self, request: web.Request, trace: Trace, result: RelayResult, bounds: RelayBounds
    ) -> web.StreamResponse:
        """The answer; a buffered one is written here, under the send-idle timeout, before the
        request is logged: a client that stops reading it is cut (499 ``client_stalled``) and its
        bytes leave the memory budget then, not whenever aiohttp's unbounded write would end."""
        resp = self.respond(trace, result)
        if not isinstance(resp, HeldResponse):
            return resp
        try:
            await resp.send(request, bounds.send_idle_timeout_s)
        except ClientStalled:
            trace.outcome, trace.status = Outcome.CLIENT_STALLED, 499
        except CLIENT_LEFT:
            trace.outcome, trace.status = Outcome.CLIENT_GONE, 499
        return resp

    def refuse(self, trace: Trace, err: ProxyError) -> web.Response:
        trace.outcome, trace.status = outcome_of(err), err.status
        resp = err.response()
        resp.headers["X-Request-Id"] = trace.reply_id
        resp.headers.update(self.limit_headers(trace))
        return resp

    def limit_headers(self, trace: Trace) -> dict[str, str]:
        tenant = trace.tenant.name if trace.tenant else None
        return ratelimit_headers(self.limits.windows(tenant, self.clock()) if tenant else {})

    def log(self, trace: Trace) -> None:
        elapsed = self.clock() - trace.arrival
        tenant = trace.tenant
        tier = tenant.tier if tenant else "-"
        if tenant is not None:
            self.child(self.metrics.requests, tier, trace.outcome).inc()
        if trace.admitted:
            self.child(self.metrics.e2e, tier).observe(elapsed)
        if trace.spans is not None:
            trace.spans.end(
                tenant.name if tenant else None,
                tenant.tier if tenant else None,
                trace.outcome,
                trace.status,
                self.clock(),
            )
        if trace.admitted and tenant is not None:  # goodput (proxy/telemetry/slo.py)
            latency = trace.latency or Latency(trace.arrival, None, self.clock(), None)
            self.metrics.slo.record(self.config().config, tenant, trace.outcome, latency)
        # Never the key: only the tenant it resolved to.
        access_log.info(
            "request_id=%s client_request_id=%s tenant=%s key_id=%s tier=%s status=%d"
            " outcome=%s duration_s=%.3f",
            trace.request_id,
            trace.client_request_id or "-",
            tenant.name if tenant else "-",
            trace.key_id,
            tier,
            trace.status,
            trace.outcome,
            elapsed,
        )
