"""``backends: kv_aware``'s hold rule: a request whose prompt's home is full waits for it, for
a while, rather than prefill its prompt again elsewhere (docs in ``proxy.policies.kvaware``)."""

from __future__ import annotations

from collections.abc import Mapping

from proxy.policies.types import QueuedRequest


class HomeHold:
    """Who waits for which home, and until when. ``holds``: tier -> the longest it waits."""

    def __init__(self, holds: Mapping[str, float], hold_share: float) -> None:
        self.holds = holds
        self.hold_share = hold_share
        # id(request) -> (the home it waits for, when its hold ends): who waits where, for the
        # per-home cap and the dispatcher's wake-up; dropped when served or its hold is over.
        self._held: dict[int, tuple[str, float]] = {}

    def waits(
        self, request: QueuedRequest, home: str, gain: float, now: float, slots: float
    ) -> bool:
        """Whether ``request`` waits on for its full ``home`` (``slots``: its room), which
        would save ``gain`` of its prompt more than the best backend with room. A hold runs
        from the request's arrival (a tenant's requests behind it wait out their holds at the
        same time, not one after another) and never past half of its queue timeout. No more
        wait for one home than it has slots (each finishing request frees one): the rest of a
        burst goes where there is room now."""
        hold = self.holds.get(request.tier, 0.0)
        if hold <= 0 or gain < self.hold_share:
            return False
        end = self._end(request, hold)
        if now >= end:
            return False
        if id(request) not in self._held:
            if self.waiting(home, now) >= slots:
                return False
            self._held[id(request)] = (home, end)
        return True

    def waiting(self, home: str, now: float) -> int:
        """How many wait for ``home`` now."""
        return sum(1 for h, e in self._held.values() if h == home and e > now)

    def next_end(self, now: float) -> float | None:
        """Seconds until the first hold still running ends; None: none is."""
        return min((end - now for _, end in self._held.values() if end > now), default=None)

    def drop(self, request: QueuedRequest) -> None:
        """``request`` was served or left: it waits no more."""
        self._held.pop(id(request), None)

    def expire(self, now: float) -> None:
        """Holds over (the request went elsewhere, timed out, or left) go."""
        if self._held:
            for gone in [k for k, (_, end) in self._held.items() if end <= now]:
                del self._held[gone]

    @staticmethod
    def _end(request: QueuedRequest, hold: float) -> float:
        end = request.arrival_s + hold
        if request.deadline_s > request.arrival_s:
            end = min(end, request.arrival_s + (request.deadline_s - request.arrival_s) / 2)
        return end
