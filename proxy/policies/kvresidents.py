"""Where each tenant lives lately, for ``backends: kv_aware``'s new placement
(``kvterms.starts_apart_on``): a tenant lives on a backend where it sent at least
``RESIDENT_SHARE`` of the prompt blocks it filled lately, and at least ``RESIDENT_BLOCKS`` of
them (one tiny request of a stranger's does not make an idle backend lived on).

Kept as it changes, not computed at each pick: every tenant's weights decay with one time
constant, so a tenant's shares change only when it sends (or a send of its is undone), and its
weight on a backend falls below ``RESIDENT_BLOCKS`` at a time known when it sends. A pick reads
a count per backend (computed over every tenant at each pick, it cost 3 ms with 2,000 tenants
and 34 ms with 20,000, on the event loop: red team, 2026-12-04).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Mapping

RESIDENT_SHARE = 0.5  # of a tenant's own weight lately: it lives on that backend
RESIDENT_BLOCKS = 8.0  # ... if that weight is at least this many blocks


class Residency:
    def __init__(self, tau_s: float, clock: Callable[[], float]) -> None:
        self.tau_s = tau_s
        self.clock = clock
        self._homes: dict[str, dict[str, float]] = {}  # tenant -> url -> when it fades there
        self._counts: Counter[str] = Counter()  # url -> tenants living there
        self._ends: list[tuple[float, str, str]] = []  # (when, tenant, url), soonest first

    def settle(self, tenant: str, weights: Mapping[str, float]) -> None:
        """``tenant``'s decayed weights per backend now (after a send of its, or an undo)."""
        self.leave(tenant)
        total = sum(weights.values())
        now = self.clock()
        homes = {
            url: now + self.tau_s * math.log(w / RESIDENT_BLOCKS)
            for url, w in weights.items()
            if w >= RESIDENT_SHARE * total and w >= RESIDENT_BLOCKS
        }
        if not homes:
            return
        self._homes[tenant] = homes
        for url, end in homes.items():
            self._counts[url] += 1
            heapq.heappush(self._ends, (end, tenant, url))
        if len(self._ends) > 2 * sum(self._counts.values()) + 1024:  # O(backends), not tenants
            self._ends = [(e, t, u) for t, h in self._homes.items() for u, e in h.items()]
            heapq.heapify(self._ends)  # entries of residencies since replaced: bounded

    def leave(self, tenant: str) -> None:
        """``tenant`` lives nowhere (until it settles again)."""
        for url in self._homes.pop(tenant, {}):
            self._drop(url)

    def residents(self, but: str | None) -> Counter[str]:
        """Per backend, the tenants other than ``but`` living there now."""
        now = self.clock()
        while self._ends and self._ends[0][0] <= now:
            end, tenant, url = heapq.heappop(self._ends)
            homes = self._homes.get(tenant)
            if homes is not None and homes.get(url) == end:  # not since replaced
                del homes[url]
                if not homes:
                    del self._homes[tenant]
                self._drop(url)
        out = Counter(self._counts)
        for url in self._homes.get(but, {}) if but is not None else ():
            out[url] -= 1
        return +out  # zeros dropped

    def _drop(self, url: str) -> None:
        self._counts[url] -= 1
        if self._counts[url] <= 0:
            del self._counts[url]
