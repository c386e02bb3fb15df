"""What each backend was sent lately, for ``backends: kv_aware``'s balance and spread rules:
weights that decay exponentially, as shares of the whole."""

from __future__ import annotations

import math
from collections.abc import Callable


class DecayingCounts:
    """Weights per key that decay exponentially (time constant ``tau_s``), and how many adds
    made them: what each backend was sent lately (in prompt blocks: the cache it fills), as
    shares of the whole."""

    def __init__(self, tau_s: float, clock: Callable[[], float]) -> None:
        self.tau_s = tau_s
        self.clock = clock
        self._weights: dict[str, float] = {}
        self._adds = 0.0
        self._at = clock()

    def add(self, key: str, weight: float = 1.0) -> None:
        self._decay()
        if weight <= 0:
            return  # nothing to judge by (a prompt it had all cached): not a share, nor a vote
        self._weights[key] = self._weights.get(key, 0.0) + weight
        self._adds += 1.0

    def remove(self, key: str, weight: float, added_at: float) -> None:
        """Undo an ``add`` of ``weight`` made at ``added_at`` (what is left of it)."""
        if weight <= 0:
            return
        self._decay()
        left = math.exp(-max(0.0, self._at - added_at) / self.tau_s)
        if key in self._weights:
            self._weights[key] = max(0.0, self._weights[key] - weight * left)
        self._adds = max(0.0, self._adds - left)

    def shares(self, at_least: float = 0.0) -> dict[str, float]:
        """Each key's share of the (decayed) total weight; none while fewer than ``at_least``
        adds (decayed alike) made it."""
        self._decay()
        total = sum(self._weights.values())
        if total <= 0 or self._adds < at_least:
            return {}
        return {k: v / total for k, v in self._weights.items()}

    def weight(self, key: str) -> float:
        """``key``'s (decayed) weight."""
        self._decay()
        return self._weights.get(key, 0.0)

    def weights(self) -> dict[str, float]:
        """Every key's (decayed) weight."""
        self._decay()
        return dict(self._weights)

    def total(self) -> float:
        """The (decayed) weight of every key."""
        self._decay()
        return sum(self._weights.values())

    def _decay(self) -> None:
        now = self.clock()
        if now > self._at:
            factor = math.exp(-(now - self._at) / self.tau_s)
            self._weights = {k: v * factor for k, v in self._weights.items() if v * factor > 1e-3}
            self._adds *= factor
            self._at = now
