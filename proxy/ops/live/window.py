"""Deltas and rates over a recent window, out of cumulative counters, on an injected clock.

The proxy's Prometheus counters already count everything the live view shows; what they lack
is "over the last minute". Each look at the status keeps a snapshot of the counters; the
window's numbers are the difference with the newest snapshot at least ``window_s`` old (or the
oldest kept, early on). No task runs: the view costs nothing when nobody looks.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

Key = tuple[str, ...]


@dataclass(frozen=True)
class WindowView:
    span_s: float  # how long the window really is (shorter early on)
    deltas: Mapping[Key, float]

    def delta(self, key: Key) -> float:
        return self.deltas.get(key, 0.0)

    def rate(self, key: Key) -> float:
        return self.delta(key) / self.span_s if self.span_s > 0 else 0.0


class CounterWindow:
    """Snapshots of cumulative counters; the counters start at zero when this is created."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s = window_s
        self.clock = clock
        self._snapshots: deque[tuple[float, dict[Key, float]]] = deque([(clock(), {})])
        # Frequent looks do not pile up snapshots: at most ~30 per window are kept.
        self._min_gap_s = window_s / 30

    def update(self, totals: Mapping[Key, float]) -> WindowView:
        now = self.clock()
        snapshots = self._snapshots
        if now - snapshots[-1][0] >= self._min_gap_s:
            snapshots.append((now, dict(totals)))
        while len(snapshots) > 2 and snapshots[1][0] <= now - self.window_s:
            snapshots.popleft()
        at, base = snapshots[0]
        # A counter never goes down; one that vanished (a reload dropped its labels) reads 0.
        deltas = {k: max(0.0, v - base.get(k, 0.0)) for k, v in totals.items()}
        return WindowView(span_s=now - at, deltas=deltas)


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The q-quantile of a Prometheus histogram's cumulative ``(le, count)`` buckets, by linear
    interpolation inside the bucket (as PromQL's ``histogram_quantile``). None: no observation.
    In the +Inf bucket it answers the largest finite bound."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            fraction = (rank - lower_count) / (count - lower_count)
            return lower_bound + (bound - lower_bound) * fraction
        lower_bound, lower_count = bound, count
    return lower_bound
