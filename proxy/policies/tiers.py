"""Which tier goes next. The selectors see only tier names and their limits."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from proxy.policies.types import TierLimits


class TierSelector(Protocol):
    def set_tiers(self, tiers: Mapping[str, TierLimits]) -> None:
        """The configured tiers (at start and on every reload)."""

    def activate(self, tier: str, backlogged: Iterable[str]) -> None:
        """A tier went from empty to non-empty; ``backlogged``: the tiers holding requests."""

    def pick(self, candidates: Iterable[str]) -> str | None:
        """The tier to serve next among those with requests."""

    def charge(self, tier: str) -> None:
        """A request of this tier was dispatched."""


class StrideTierSelector:
    """Stride scheduling: each pick of a tier advances its pass by 1/weight; lowest pass wins.

    Over any window where tiers stay backlogged, they are picked in proportion to their weights
    (within one pick per tier). A tier with nothing waiting is skipped (work-conserving), and one
    that comes back from idle starts at the current minimum pass, so idle time banks no credit.
    """

    def __init__(self) -> None:
        self._weights: dict[str, float] = {}
        self._pass: dict[str, float] = {}
        self._order: dict[str, int] = {}

    def set_tiers(self, tiers: Mapping[str, TierLimits]) -> None:
        weights = {tier: limits.weight for tier, limits in tiers.items()}
        for tier, weight in weights.items():
            if weight <= 0:
                raise ValueError(f"tier {tier!r}: weight must be positive")
        self._weights = weights
        # Ties break by weight, heaviest first, then by name for determinism.
        ranked = sorted(weights, key=lambda t: (-weights[t], t))
        self._order = {t: i for i, t in enumerate(ranked)}
        floor = min(self._pass.values(), default=0.0)
        self._pass = {t: self._pass.get(t, floor) for t in weights}

    def activate(self, tier: str, backlogged: Iterable[str]) -> None:
        others = [self._pass[t] for t in backlogged if t != tier and t in self._pass]
        if others:
            self._pass[tier] = max(self._pass[tier], min(others))

    def pick(self, candidates: Iterable[str]) -> str | None:
        best: str | None = None
        best_key = (0.0, 0)
        for tier in candidates:
            if tier in self._weights:
                key = (self._pass[tier], self._order[tier])
                if best is None or key < best_key:
                    best, best_key = tier, key
        return best

    def charge(self, tier: str) -> None:
        self._pass[tier] += 1.0 / self._weights[tier]


class StrictPriorityTierSelector:
    """Always the best-priority (lowest number) tier that holds requests, as vLLM's priority
    scheduling and LiteLLM do: a busy better tier starves the worse ones by design."""

    def __init__(self) -> None:
        self._priority: dict[str, int] = {}

    def set_tiers(self, tiers: Mapping[str, TierLimits]) -> None:
        self._priority = {tier: limits.priority for tier, limits in tiers.items()}

    def activate(self, tier: str, backlogged: Iterable[str]) -> None:
        pass

    def pick(self, candidates: Iterable[str]) -> str | None:
        return min(
            (t for t in candidates if t in self._priority),
            key=lambda t: (self._priority[t], t),
            default=None,
        )

    def charge(self, tier: str) -> None:
        pass
