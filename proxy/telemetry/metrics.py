"""The proxy's Prometheus metrics, in a registry of its own (one per app, so tests can run
several apps in one process)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from proxy.telemetry.adapter_metrics import AdapterMetrics
from proxy.telemetry.kvmetrics import KvIndexMetrics
from proxy.telemetry.slo import SloMetrics

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class CountedElsewhere(Collector):
    """A counter kept by another object (read at each scrape): the listeners count their own
    evictions, and the server wires ``read`` once they exist."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.read: Callable[[], float] = lambda: 0.0
        registry.register(self)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation)
        family.add_metric([], self.read())
        yield family


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge(
            "tierproxy_queue_depth", "Requests waiting in the proxy, by tier", ["tier"], registry=r
        )
        self.queue_wait = Histogram(
            "tierproxy_queue_wait_seconds",
            "Time from admission to dispatch (or giving up), by tier",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "tierproxy_requests",
            "Finished requests by tier and outcome",
            ["tier", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "tierproxy_time_to_first_token_seconds",
            "From arrival at the proxy (queueing included) to the first streamed token, by tier",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tierproxy_request_duration_seconds",
            "From arrival at the proxy to the end of the response, by tier",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "tierproxy_tokens",
            "Tokens reported by the backends' usage, by tier and kind",
            ["tier", "kind"],
            registry=r,
        )
        self.backend_inflight = Gauge(
            "tierproxy_backend_inflight", "Requests in flight per backend", ["backend"], registry=r
        )
        self.backend_available = Gauge(
            "tierproxy_backend_available",
            "1 when the backend takes new work (healthy, not ejected, not draining)",
            ["backend"],
            registry=r,
        )
        self.backend_clock_offset = Gauge(
            "tierproxy_backend_clock_offset_seconds",
            "Each backend's clock minus this host's, from the Date header of its /metrics"
            " (±0.5 s); tickets for it are stamped on its clock from 1 s apart",
            ["backend"],
            registry=r,
        )
        self.backend_metrics_age = Gauge(
            "tierproxy_backend_metrics_age_seconds",
            "Age of the last successful /metrics scrape per backend (stale ones are ignored)",
            ["backend"],
            registry=r,
        )
        self.backend_probe_failures = Counter(
            "tierproxy_backend_probe_failures",
            "Failed probes of a backend (health, metrics, models) by reason: error (refused,"
            " timeout, reset), status (not 200), oversize (past its cap), invalid (unreadable)",
            ["backend", "probe", "reason"],
            registry=r,
        )
        self.backend_errors = Counter(
            "tierproxy_backend_errors",
            "Upstream failures per backend and kind",
            ["backend", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "tierproxy_retries", "Requests retried on another backend", registry=r
        )
        self.rate_limited = Counter(
            "tierproxy_rate_limited",
            "Requests refused or delayed by a tenant limit",
            ["tenant", "limit"],
            registry=r,
        )
        self.config_reloads = Counter(
            "tierproxy_config_reloads", "Config reload attempts by result", ["result"], registry=r
        )
        self.config_generation = Gauge(
            "tierproxy_config_generation", "Number of configs loaded so far", registry=r
        )
        self.open_connections = Gauge(
            "tierproxy_open_connections",
            "Open client connections on all listeners (server.max_connections caps them)",
            registry=r,
        )
        self.connections_refused = Counter(
            "tierproxy_connections_refused",
            "Client connections refused at the server.max_connections cap (503 then closed)",
            registry=r,
        )
        self.connections_evicted = CountedElsewhere(
            "tierproxy_connections_evicted",
            "Connections still waiting for a request head closed at the server.max_connections"
            " cap to let a newcomer in (server.evict_at_cap)",
            r,
        )
        # Goodput, early refusals and backend room (proxy/telemetry/slo.py, docs/slo.md).
        self.slo = SloMetrics(r)
        self.kv = KvIndexMetrics(r)  # the prefix-cache indexes (proxy.backends.kvevents)
        self.adapters = AdapterMetrics(r)  # per LoRA adapter (docs/adapters.md)
        # What a soak watches for leaks: process_resident_memory_bytes, process_open_fds, ...
        ProcessCollector(registry=r)
        self.event_loop_tasks = Gauge(
            "tierproxy_event_loop_tasks",
            "asyncio tasks alive on the proxy's event loop (read when /metrics is served)",
            registry=r,
        )
        self.event_loop_tasks.set_function(_live_tasks)


def _live_tasks() -> float:
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:  # read outside the event loop's thread: nothing to count
        return 0
