"""Per-backend room and state as Prometheus gauges, computed when /metrics is scraped (room
depends on the clock: ramps, ejections, vLLM's scraped queue)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy.backends.pool import BackendPool
from proxy.config.schema import Config
from proxy.ops.live.status import backend_state
from proxy.scheduling.queue import AdmissionQueue

STATES = ("healthy", "ramping", "ejected", "down", "draining")


class BackendRoomCollector(Collector):
    def __init__(self, pool: BackendPool, clock: Callable[[], float]) -> None:
        self.pool = pool
        self.clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = self.clock()
        room = GaugeMetricFamily(
            "tierproxy_backend_free_slots",
            "Free request slots per backend now (ramps, ejections and vLLM's own queue count)",
            labels=["backend"],
        )
        state = GaugeMetricFamily(
            "tierproxy_backend_state",
            "1 for the state each backend is in: " + " | ".join(STATES),
            labels=["backend", "state"],
        )
        for b in self.pool.all():
            room.add_metric([b.label], self.pool.room(b, now))
            current = backend_state(b, now, self.pool.health.ramp_s)
            for name in STATES:
                state.add_metric([b.label, name], 1.0 if name == current else 0.0)
        yield room
        yield state


class TierCollector(Collector):
    """What the alerts (configs/prometheus/) measure a tier against, from the live config
    (a reload changes it): its queue cap beside ``tierproxy_queue_depth``, and the share of
    its requests its SLO wants met (``slo.percentile``) beside ``tierproxy_slo_met_total``."""

    def __init__(self, queue: AdmissionQueue, config: Callable[[], Config]) -> None:
        self.queue = queue
        self.config = config

    def collect(self) -> Iterator[GaugeMetricFamily]:
        cap = GaugeMetricFamily(
            "tierproxy_queue_max",
            "Each tier's queue cap (tiers.<tier>.max_queue, per replica): queue_full at it",
            labels=["tier"],
        )
        for tier in self.queue.tiers():
            cap.add_metric([tier], self.queue.limits(tier).max_queue)
        objective = GaugeMetricFamily(
            "tierproxy_slo_objective",
            "Share of a tier's requests that must meet its SLO (slo.percentile / 100); tiers"
            " with an slo only",
            labels=["tier"],
        )
        for name, limits in self.config().tiers.items():
            if limits.slo is not None:
                objective.add_metric([name], limits.slo.percentile / 100.0)
        yield cap
        yield objective
