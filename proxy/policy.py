"""Dequeue policies: which tier, which tenant, which request goes next.

Plain objects with no I/O and no clock of their own; the admission queue calls them. Each one
is swappable on its own:

- ``WeightedTierSelector``: stride scheduling across tiers by weight, work-conserving.
- ``VirtualTokenCounter``: fairness across tenants of one tier by weighted tokens served.
- ``short_first_key``: inside one tenant, short requests first, with aging.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# Output tokens cost more than prompt tokens (decode steps vs one batched prefill), as in VTC.
OUTPUT_TOKEN_WEIGHT = 2.0


def weighted_tokens(prompt_tokens: float, output_tokens: float) -> float:
    return prompt_tokens + OUTPUT_TOKEN_WEIGHT * output_tokens


class WeightedTierSelector:
    """Stride scheduling: each pick of a tier advances its pass by 1/weight; lowest pass wins.

    Over any window where tiers stay backlogged, they are picked in proportion to their weights
    (within one pick per tier). A tier with nothing waiting is skipped (work-conserving), and one
    that comes back from idle starts at the current minimum pass, so idle time banks no credit.
    """

    def __init__(self, weights: Mapping[str, float]) -> None:
        self._weights: dict[str, float] = {}
        self._pass: dict[str, float] = {}
        self._order: dict[str, int] = {}
        self.set_weights(weights)

    def set_weights(self, weights: Mapping[str, float]) -> None:
        for tier, weight in weights.items():
            if weight <= 0:
                raise ValueError(f"tier {tier!r}: weight must be positive")
        self._weights = dict(weights)
        # Ties break by weight, heaviest first, then by name for determinism.
        ranked = sorted(self._weights, key=lambda t: (-self._weights[t], t))
        self._order = {t: i for i, t in enumerate(ranked)}
        floor = min(self._pass.values(), default=0.0)
        self._pass = {t: self._pass.get(t, floor) for t in self._weights}

    def activate(self, tier: str, backlogged: Iterable[str]) -> None:
        """A tier went from empty to non-empty: lift its pass to the backlogged minimum."""
        others = [self._pass[t] for t in backlogged if t != tier and t in self._pass]
        if others:
            self._pass[tier] = max(self._pass[tier], min(others))

    def pick(self, candidates: Iterable[str]) -> str | None:
        best = min(
            (t for t in candidates if t in self._weights),
            key=lambda t: (self._pass[t], self._order[t]),
            default=None,
        )
        return best

    def charge(self, tier: str) -> None:
        self._pass[tier] += 1.0 / self._weights[tier]


class VirtualTokenCounter:
    """Fair share across tenants by weighted tokens served, divided by the tenant's weight.

    The tenant with the least service so far goes next. Estimated tokens are charged at dispatch
    and corrected with the real usage when the request ends. A tenant returning from idle is
    lifted to the minimum counter among the backlogged, so it cannot claim its idle time back.
    """

    def __init__(self) -> None:
        self._counter: dict[str, float] = {}

    def counter(self, tenant: str) -> float:
        return self._counter.get(tenant, 0.0)

    def activate(self, tenant: str, backlogged: Iterable[str]) -> None:
        others = [self._counter.get(t, 0.0) for t in backlogged if t != tenant]
        floor = min(others) if others else max(self._counter.values(), default=0.0)
        self._counter[tenant] = max(self._counter.get(tenant, 0.0), floor)

    def pick(self, candidates: Iterable[str]) -> str | None:
        return min(candidates, key=lambda t: (self._counter.get(t, 0.0), t), default=None)

    def charge(self, tenant: str, weighted: float, tenant_weight: float = 1.0) -> None:
        self._counter[tenant] = self._counter.get(tenant, 0.0) + weighted / tenant_weight

    def forget(self, keep: Iterable[str]) -> None:
        """Drop counters of tenants that no longer exist (after a config reload)."""
        kept = set(keep)
        self._counter = {t: c for t, c in self._counter.items() if t in kept}


def short_first_key(
    weighted_cost: float, arrival_s: float, *, reference_tokens: float, aging_s: float
) -> float:
    """Order inside a tenant: smaller keys first.

    key = min(cost / reference, 1) + arrival / aging_s. Since the cost term lies in [0, 1], a
    request is never overtaken by one that arrived ``aging_s`` or more after it: a long
    document waits behind short questions for at most that long plus the work ahead of it.
    The key does not depend on the current time, so it can live in a heap.
    """
    return min(weighted_cost / reference_tokens, 1.0) + arrival_s / aging_s
