"""The config sections about latency targets (issue #16): a tier's SLO and the controller that
sizes each backend's room from it (docs/slo.md)."""

from __future__ import annotations

from pydantic import Field, model_validator

from proxy.config.base import Strict


class TierSlo(Strict):
    """A tier's latency target: ``percentile`` % of its requests get their first token within
    ``ttft_s`` (from arrival at the proxy, queueing included) and then a token every ``itl_s``
    on average. A request that met both (and ended ok) counts toward the tier's goodput."""

    ttft_s: float | None = Field(
        None, gt=0, description="Time to first token, from arrival at the proxy (queue included)."
    )
    itl_s: float | None = Field(
        None, gt=0, description="Mean time between tokens after the first (inter-token latency)."
    )
    percentile: float = Field(
        99.0, gt=0, lt=100, description="Share of the tier's requests that must meet the targets."
    )

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

    initial_room: int = Field(8, ge=1, description="The room a backend starts with.")
    min_room: int = Field(2, ge=1, description="The room never shrinks below this.")
    max_room: int = Field(
        256,
        ge=1,
        description="The ceiling of a backend without max_inflight (with it, max_inflight is the"
        " ceiling).",
    )
    adjust_every_s: float = Field(
        1.0,
        gt=0,
        description="No two changes closer than this; each change waits for a /metrics scrape"
        " taken after it.",
    )
    increase_ratio: float = Field(
        0.1, gt=0, le=1, description="Growth per step once vLLM has queued (room * (1 + it))."
    )
    decrease_ratio: float = Field(
        0.8,
        gt=0,
        lt=1,
        description="Shrink factor on KV-pressure preemptions or slipping targets (room * it).",
    )
    kv_high: float = Field(
        0.9,
        gt=0,
        le=1,
        description="KV-cache usage above which the room does not grow (vLLM would soon preempt).",
    )
    slo_window_s: float = Field(
        10.0,
        gt=0,
        description="Latency observations of a backend's requests kept to judge targets.",
    )
    slo_min_samples: int = Field(
        20, ge=1, description="Observations needed in the window before targets are judged."
    )

    def ceiling(self, max_inflight: int | None) -> float:
        """The most a backend's learned room grows to: its ``max_inflight``, else ``max_room``."""
        return float(max_inflight or self.max_room)

    @model_validator(mode="after")
    def _bounds(self) -> AdaptiveRoom:
        if not self.min_room <= self.initial_room <= self.max_room:
            raise ValueError("need min_room <= initial_room <= max_room")
        return self
