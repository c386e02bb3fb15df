"""``backends: kv_aware``'s spread rule: which backends took more than ``max_share`` of the
requests sent lately, and which of those a tenant's own requests crowd (docs in
``proxy.policies.kvaware``)."""

from __future__ import annotations

from collections.abc import Callable

from proxy.policies.kvrecent import DecayingCounts

SWEEP_EVERY = 1024  # sends between sweeps of the tenants whose counts have faded


class RequestShares:
    """Requests sent lately per backend, in all and per tenant (weights that decay over
    ``tau_s``; shares judged once ``at_least`` requests were sent lately)."""

    def __init__(
        self, max_share: float, tau_s: float, at_least: float, clock: Callable[[], float]
    ) -> None:
        self.max_share = max_share
        self.tau_s = tau_s
        self.at_least = at_least
        self.clock = clock
        self._all = DecayingCounts(tau_s, clock)  # backend url -> requests sent lately
        self._tenants: dict[str, DecayingCounts] = {}  # tenant -> its own, per backend url
        self._sends = 0

    def sent(self, url: str, tenant: str | None) -> None:
        self._all.add(url)
        if tenant is not None:
            self._of(tenant).add(url)
        self._sends += 1
        if self._sends % SWEEP_EVERY == 0:  # bounded by the tenants active lately
            faded = [t for t, counts in self._tenants.items() if counts.total() <= 0]
            for tenant in faded:
                del self._tenants[tenant]

    def unsent(self, url: str, tenant: str | None, at: float) -> None:
        """Undo a ``sent`` made at ``at`` (a request the engine did not run)."""
        self._all.remove(url, 1.0, at)
        if tenant is not None and (counts := self._tenants.get(tenant)) is not None:
            counts.remove(url, 1.0, at)

    def crowded(self, n: int) -> frozenset[str]:
        """The backends past ``max_share`` of the requests sent lately (none while one backend
        alone, of ``n``, can take the request)."""
        if n < 2:
            return frozenset()
        shares = self._all.shares(at_least=self.at_least)
        return frozenset(url for url, share in shares.items() if share > self.max_share)

    def own_crowded(self, tenant: str | None, crowded: frozenset[str]) -> frozenset[str]:
        """Of the ``crowded`` backends, those where ``tenant``'s own requests lately are at
        least the backend's excess over ``max_share``: the spread rule moves a tenant's new
        conversation off a crowded home only when its own traffic could account for the
        crowd, never for another tenant's flood alone."""
        counts = self._tenants.get(tenant) if tenant is not None else None
        if counts is None or not crowded:
            return frozenset()
        total = self._all.total()
        return frozenset(
            url
            for url in crowded
            if counts.weight(url) >= self._all.weight(url) - self.max_share * total
        )

    def tenants(self) -> int:
        """How many tenants' counts are kept (bounded: faded ones are swept)."""
        return len(self._tenants)

    def _of(self, tenant: str) -> DecayingCounts:
        counts = self._tenants.get(tenant)
        if counts is None:
            counts = self._tenants[tenant] = DecayingCounts(self.tau_s, self.clock)
        return counts
