"""Per-backend room and state as Prometheus gauges, computed when /metrics is scraped (room
depends on the clock: ramps, ejections, vLLM's scraped queue)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy.ops.live.status import backend_state
from proxy.scheduling.pool import BackendPool

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
