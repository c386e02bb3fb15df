"""Early refusal: a request that cannot start within its tier's queue timeout is told so at
once (429, ``Retry-After`` the predicted wait) instead of after the whole timeout (503).

The prediction is its position in the tier's order over the tier's observed service rate:

- position: the requests ahead of it. The fairness policies serve a tier's backlogged tenants
  in turn, so a tenant holding ``k`` requests with ``n`` tenants backlogged waits behind about
  ``(k + 1) * n`` of them, and never behind more than the whole tier;
- service rate: how fast the tier's requests left the queue while it stayed backlogged (the
  gaps between dispatches of the tier that each left others of it waiting). Gaps measured
  while the tier had nothing queued say how fast requests arrived, not how fast they are
  served, and are ignored.

Until ``min_samples`` such gaps were seen it predicts nothing and refuses nothing (today's
behaviour): a refusal always rests on a measured rate.
"""

from __future__ import annotations

from collections import deque


class EarlyRefusal(Exception):
    def __init__(self, tier: str, predicted_wait_s: float) -> None:
        super().__init__(f"predicted wait {predicted_wait_s:.1f}s in tier {tier!r}")
        self.tier = tier
        self.predicted_wait_s = predicted_wait_s


class TierServiceRate:
    """Dispatches per second of one tier while it stays backlogged (the last ``keep`` gaps)."""

    def __init__(self, keep: int = 64, min_samples: int = 8) -> None:
        self.min_samples = min_samples
        self._gaps: deque[float] = deque(maxlen=keep)
        self._last: float | None = None  # last dispatch that left the tier backlogged

    def dispatched(self, now: float, still_backlogged: bool) -> None:
        if self._last is not None:
            self._gaps.append(now - self._last)
        self._last = now if still_backlogged else None

    def per_second(self) -> float | None:
        if len(self._gaps) < self.min_samples:
            return None
        total = sum(self._gaps)
        return len(self._gaps) / total if total > 0 else None


class ServiceRates:
    """Every tier's service rate, and the predicted wait of a newcomer."""

    def __init__(self) -> None:
        self.tiers: dict[str, TierServiceRate] = {}

    def dispatched(self, tier: str, now: float, tier_depth_after: int) -> None:
        rate = self.tiers.get(tier)
        if rate is None:
            rate = self.tiers[tier] = TierServiceRate()
        rate.dispatched(now, tier_depth_after > 0)

    def predicted_wait(
        self, tier: str, tier_depth: int, tenant_depth: int, tenants: int
    ) -> float | None:
        """Seconds until a newcomer of a tenant holding ``tenant_depth`` requests would leave
        the queue; None when the tier's rate is not known yet."""
        if tier_depth == 0:
            return 0.0
        rate = self.tiers.get(tier)
        per_second = rate.per_second() if rate is not None else None
        if per_second is None:
            return None
        backlogged = tenants + (tenant_depth == 0)
        ahead = min(tier_depth, (tenant_depth + 1) * backlogged)
        return ahead / per_second
