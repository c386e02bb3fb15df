"""Tier latency targets at work: did a request meet its tier's SLO (goodput), and did the
backend's part of it (for the backend's room controller). Metrics of both, and of the room.

Goodput counts every request of a tier with an ``slo:`` that passed authentication and parsing,
except those the client ended or caused (left, stalled, refused input, its own rate limit);
it met the SLO when it ended ok, its first token came within ``ttft_s`` of its arrival at the
proxy and its tokens then came ``itl_s`` apart on average. Tenant labels are the config's
tenant names only (the request authenticated as one), so they stay bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from proxy.api.outcome import Outcome
from proxy.api.usage import token_usage
from proxy.config.schema import Config
from proxy.config.slo import TierSlo
from proxy.config.tenants import Tenant

# Endings that say nothing about the service: the client left, stalled, sent bad input or ran
# into its own tenant's rate limit.
_NOT_COUNTED = frozenset(
    {
        Outcome.CLIENT_GONE,
        Outcome.CLIENT_STALLED,
        Outcome.REJECTED,
        Outcome.CLIENT_ERROR,
        Outcome.RATE_LIMITED,
        Outcome.UNAUTHORIZED,
    }
)


@dataclass(frozen=True, slots=True)
class Latency:
    """What a request's answer looked like in time."""

    start: float  # arrival at the proxy, or dispatch for the backend's part
    first_token_at: float | None
    end: float
    completion_tokens: int | None

    @property
    def ttft_s(self) -> float:
        # No first token seen (a non-streamed answer): the whole answer is the first token.
        first = self.first_token_at if self.first_token_at is not None else self.end
        return first - self.start

    @property
    def itl_s(self) -> float | None:
        """Mean gap between tokens after the first; None with fewer than two tokens."""
        n = self.completion_tokens
        if self.first_token_at is None or n is None or n < 2:
            return None
        return max(0.0, self.end - self.first_token_at) / (n - 1)


def meets(slo: TierSlo, latency: Latency) -> bool:
    if slo.ttft_s is not None and latency.ttft_s > slo.ttft_s:
        return False
    itl = latency.itl_s
    return slo.itl_s is None or itl is None or itl <= slo.itl_s


def counts_for_goodput(outcome: Outcome) -> bool:
    return outcome not in _NOT_COUNTED


def slo_miss_budget(config: Config) -> float:
    """Share of requests a backend's room may let miss their target: that of the strictest
    tier percentile (1 % when no tier has an SLO)."""
    percentiles = [t.slo.percentile for t in config.tiers.values() if t.slo is not None]
    return 1.0 - max(percentiles, default=99.0) / 100.0


class Answer(Protocol):
    """What of a relayed answer the judging reads (``proxy.relay.forward.RelayResult``)."""

    outcome: Outcome
    first_token_at: float | None
    usage: dict[str, Any] | None


def latency_of(start: float, answer: Answer, now: float) -> Latency:
    counts = token_usage(answer.usage)
    return Latency(start, answer.first_token_at, now, counts.completion if counts else None)


def backend_met(slo: TierSlo | None, granted_at: float, answer: Answer, now: float) -> bool | None:
    """Whether the backend's part of a request (from dispatch) met its tier's target; None
    when there is no target or the answer says nothing about speed (an error)."""
    if slo is None or answer.outcome not in (Outcome.OK, Outcome.TIMEOUT):
        return None
    return answer.outcome == Outcome.OK and meets(slo, latency_of(granted_at, answer, now))


class SloMetrics:
    """Goodput, early refusals and backend room, in the proxy's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            "tierproxy_slo_requests",
            "Requests of tiers with an SLO that count for goodput, by tier and tenant",
            ["tier", "tenant"],
            registry=r,
        )
        self.met = Counter(
            "tierproxy_slo_met",
            "Requests that met their tier's SLO (goodput = met / requests), by tier and tenant",
            ["tier", "tenant"],
            registry=r,
        )
        self.early_refusals = Counter(
            "tierproxy_early_refusals",
            "Requests refused at once because their predicted wait exceeded the queue timeout",
            ["tier"],
            registry=r,
        )
        self.backend_room = Gauge(
            "tierproxy_backend_room",
            "Requests a backend may hold at once (max_inflight, or what its controller learned)",
            ["backend"],
            registry=r,
        )
        self.backend_transit = Gauge(
            "tierproxy_backend_transit",
            "Requests in flight to a backend that vLLM's scheduler does not hold (in its API"
            " server on the way in or out), at the last scrape; the adaptive room covers them",
            ["backend"],
            registry=r,
        )
        self.backend_room_changes = Counter(
            "tierproxy_backend_room_changes",
            "Changes of a backend's adaptive room, by reason (grow, queued, preempted, slo)",
            ["backend", "reason"],
            registry=r,
        )

    def record(self, config: Config, tenant: Tenant, outcome: Outcome, latency: Latency) -> None:
        """Count a finished request of ``tenant`` toward its tier's goodput."""
        tier = config.tiers.get(tenant.tier)
        if tier is None or tier.slo is None or not counts_for_goodput(outcome):
            return
        self.requests.labels(tenant.tier, tenant.name).inc()
        if outcome == Outcome.OK and meets(tier.slo, latency):
            self.met.labels(tenant.tier, tenant.name).inc()
