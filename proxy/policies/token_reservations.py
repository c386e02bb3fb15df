"""Which backend drains for a request that does not fit its token budget.

Under ``max_tokens_inflight`` a request whose tokens do not fit beside the work in flight waits,
and dispatch fills the freed tokens with smaller requests behind it. Under another tenant's
steady load the backend never has that much free, so the larger request waited out its queue
timeout (a 503: red team, stop 50). As backfilling schedulers reserve for the job at the head,
the first such request in dispatch order holds one backend for itself: requests of its tier or
worse go elsewhere or wait, so the work in flight there ends until it fits (one larger than the
whole budget, until the backend is idle). A strictly better tier still passes: a batch job's
drain never holds an interactive request back. The hold lasts while its request is its tenant's
next in its tier, and ends when it leaves the queue (sent, expired, its client gone). A tenant
holds one backend at most, whatever it queues. Plain bookkeeping: the pool asks, no clock, no
I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from proxy.policies.types import QueuedRequest, State


class TokenReservations:
    def __init__(
        self,
        ranks: Mapping[str, int] | None = None,
        is_next: Callable[[QueuedRequest], bool] | None = None,
    ) -> None:
        self.ranks: Mapping[str, int] = ranks or {}  # tier -> priority, lower is better
        # Whether a request is its tenant's next in its tier (the queue's ``is_next``; set by
        # the builder). Without it, whether it is queued.
        self.is_next = is_next or (lambda req: req.state is State.QUEUED)
        self._holder: dict[str, QueuedRequest] = {}  # backend url -> the request it drains for

    def holder(self, url: str) -> QueuedRequest | None:
        """The request ``url`` drains for, if any. A hold lasts while its request is its
        tenant's next: one that a shorter request of its own tenant went ahead of (the order
        policy's pick) would never be tried while the backend sat idle (red team, stop 51)."""
        held = self._holder.get(url)
        if held is not None and not self.is_next(held):
            del self._holder[url]
            return None
        return held

    def admits(self, url: str, request: QueuedRequest | None) -> bool:
        """Whether ``request`` may go to ``url``: it is not held, held for ``request``, or
        ``request``'s tier is strictly better than the holder's."""
        held = self.holder(url)
        if held is None or held is request:
            return True
        return request is not None and self._rank(request) < self._rank(held)

    def reserve(self, request: QueuedRequest, refused: Mapping[str, float]) -> str | None:
        """``request`` fits none of the backends ``refused`` for tokens (url -> its tokens in
        flight; each serves it and is available): the one with the fewest tokens in flight
        drains for it, unless it already holds one of them. A better-tier request takes over a
        worse one's hold. Which url holds for it, if any."""
        for url in refused:
            if self._holder.get(url) is request:
                return url
        self.release(request)  # a hold on a backend it can no longer use (ejected, failed)
        if any(held.tenant == request.tenant for held in self.held().values()):
            return None  # one hold a tenant: its large requests never drain every backend
        free = [url for url in refused if self._takes_over(url, request)]
        if not free:
            return None
        chosen = min(free, key=lambda url: (refused[url], url))
        self._holder[chosen] = request
        return chosen

    def held(self) -> dict[str, QueuedRequest]:
        """Every live hold, by backend url."""
        return {url: req for url in list(self._holder) if (req := self.holder(url)) is not None}

    def forget(self, urls: Iterable[str]) -> None:
        """Backends that left the configuration hold nothing."""
        for url in urls:
            self._holder.pop(url, None)

    def release(self, request: QueuedRequest) -> None:
        """``request`` holds nothing any more (sent, or about to hold another backend)."""
        for url in [u for u, r in self._holder.items() if r is request]:
            del self._holder[url]

    def _takes_over(self, url: str, request: QueuedRequest) -> bool:
        held = self.holder(url)
        return held is None or self._rank(request) < self._rank(held)

    def _rank(self, request: QueuedRequest) -> int:
        """Its tier's priority; a tier a reload removed ranks worst (it passed every hold)."""
        rank = self.ranks.get(request.tier)
        return rank if rank is not None else max(self.ranks.values(), default=0) + 1
