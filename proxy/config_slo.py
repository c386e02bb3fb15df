"""The config sections about latency targets (issue #16): a tier's SLO and the controller that
sizes each backend's room from it (docs/slo.md)."""

from __future__ import annotations

from pydantic import Field, model_validator

from proxy.config_server import Strict


class TierSlo(Strict):
    """A tier's latency target: ``percentile`` % of its requests get their first token within
    ``ttft_s`` (from arrival at the proxy, queueing included) and then a token every ``itl_s``
    on average. A request that met both (and ended ok) counts toward the tier's goodput."""

    ttft_s: float | None = Field(None, gt=0)
    itl_s: float | None = Field(None, gt=0)
    percentile: float = Field(99.0, gt=0, lt=100)

    @model_validator(mode="after")
    def _some_target(self) -> TierSlo:
        if self.ttft_s is None and self.itl_s is None:
            raise ValueError("give ttft_s, itl_s or both")
        return self


class AdaptiveRoom(Strict):
    """How a backend without a hand-set ``max_inflight`` (or with ``adaptive: true``) learns
    its room: it starts at ``initial_room``, doubles while vLLM runs everything it gets, jumps
    to what vLLM really runs once vLLM starts to queue, then grows by ``increase_ratio`` and
    shrinks by ``decrease_ratio`` (preemptions, slipping targets)."""

    initial_room: int = Field(8, ge=1)
    min_room: int = Field(2, ge=1)
    # The ceiling of a backend without max_inflight (with it, max_inflight is the ceiling).
    max_room: int = Field(256, ge=1)
    # No two changes closer than this; each change waits for a /metrics scrape taken after it.
    adjust_every_s: float = Field(1.0, gt=0)
    increase_ratio: float = Field(0.1, gt=0, le=1)
    decrease_ratio: float = Field(0.8, gt=0, lt=1)
    # KV-cache usage above which the room does not grow (vLLM would soon preempt).
    kv_high: float = Field(0.9, gt=0, le=1)
    # Latency observations of a backend's requests kept to judge its targets, and how many it
    # needs before it judges at all.
    slo_window_s: float = Field(10.0, gt=0)
    slo_min_samples: int = Field(20, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> AdaptiveRoom:
        if not self.min_room <= self.initial_room <= self.max_room:
            raise ValueError("need min_room <= initial_room <= max_room")
        return self
