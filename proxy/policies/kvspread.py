"""What each backend was sent lately, in all and per tenant, for ``backends: kv_aware``'s
balance and spread rules: which backends took more than ``max_share`` of it, and which of those
a tenant's own work crowds (docs in ``proxy.policies.kvaware``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

from proxy.policies.kvrecent import DecayingCounts
from proxy.policies.kvresidents import Residency

SWEEP_EVERY = 1024  # sends between sweeps of the tenants whose counts have faded


class RecentShares:
    """Weights sent lately per backend (requests, or the prompt blocks they filled), in all and
    per tenant, decaying over ``tau_s``; shares judged once ``at_least`` adds made them."""

    def __init__(
        self, max_share: float, tau_s: float, at_least: float, clock: Callable[[], float]
    ) -> None:
        self.max_share = max_share
        self.tau_s = tau_s
        self.at_least = at_least
        self.clock = clock
        self._all = DecayingCounts(tau_s, clock)  # backend url -> weight sent lately
        self._tenants: dict[str, DecayingCounts] = {}  # tenant -> its own, per backend url
        self._sends = 0
        self._residency = Residency(tau_s, clock)  # where each tenant lives lately

    def sent(self, url: str, tenant: str | None, weight: float = 1.0) -> None:
        self._all.add(url, weight)
        if tenant is not None:
            counts = self._of(tenant)
            counts.add(url, weight)
            self._residency.settle(tenant, counts.weights())
        self._sends += 1
        if self._sends % SWEEP_EVERY == 0:  # bounded by the tenants active lately
            faded = [t for t, counts in self._tenants.items() if counts.total() <= 0]
            for tenant in faded:
                del self._tenants[tenant]
                self._residency.leave(tenant)

    def unsent(self, url: str, tenant: str | None, at: float, weight: float = 1.0) -> None:
        """Undo a ``sent`` made at ``at`` (a request the engine did not run)."""
        self._all.remove(url, weight, at)
        if tenant is not None and (counts := self._tenants.get(tenant)) is not None:
            counts.remove(url, weight, at)
            self._residency.settle(tenant, counts.weights())

    def shares(self, at_least: float | None = None) -> dict[str, float]:
        """Each backend's share of the weight sent lately (none while fewer than ``at_least``
        sends made it: by default, the ``at_least`` it was made with)."""
        return self._all.shares(at_least=self.at_least if at_least is None else at_least)

    def crowded(self, n: int) -> frozenset[str]:
        """The backends past ``max_share`` of the weight sent lately (none while one backend
        alone, of ``n``, can take the request)."""
        return _past(self.shares(), self.max_share) if n >= 2 else frozenset()

    def own_crowded(self, tenant: str | None, n: int) -> frozenset[str]:
        """Of the ``crowded`` backends, those where ``tenant``'s own weight lately is at least
        the backend's excess over ``max_share``: its own work could account for the crowd."""
        counts = self._tenants.get(tenant) if tenant is not None else None
        crowded = self.crowded(n)
        if counts is None or not crowded:
            return frozenset()
        total = self._all.total()
        return frozenset(
            url
            for url in crowded
            if counts.weight(url) >= self._all.weight(url) - self.max_share * total
        )

    def residents(self, but: str | None) -> Counter[str]:
        """Per backend, the tenants other than ``but`` living there lately
        (``proxy.policies.kvresidents``)."""
        return self._residency.residents(but)

    def tenants(self) -> int:
        """How many tenants' counts are kept (bounded: faded ones are swept)."""
        return len(self._tenants)

    def _of(self, tenant: str) -> DecayingCounts:
        counts = self._tenants.get(tenant)
        if counts is None:
            counts = self._tenants[tenant] = DecayingCounts(self.tau_s, self.clock)
        return counts


def _past(shares: Mapping[str, float], cap: float) -> frozenset[str]:
    return frozenset(url for url, share in shares.items() if share > cap)
