"""Open-loop arrival processes: Poisson, and gamma-distributed gaps for bursty traffic.

Deterministic for a given ``random.Random``; bounded in count and in time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """From ``start`` to ``end`` seconds, requests arrive at ``rate`` per second on average."""

    start: float
    end: float
    rate: float


def poisson_arrivals(
    rate: float, start: float, end: float, rng: random.Random, max_count: int
) -> list[float]:
    """Arrival times of a Poisson process (exponential gaps) in [start, end)."""
    return gamma_arrivals(rate, 1.0, start, end, rng, max_count)


def gamma_arrivals(
    rate: float, cv: float, start: float, end: float, rng: random.Random, max_count: int
) -> list[float]:
    """Arrival times in [start, end) with gamma-distributed gaps of mean 1/rate.

    ``cv`` is the gaps' coefficient of variation: 1 is Poisson, above 1 is bursty (clumps of
    close arrivals separated by long lulls), below 1 is more regular. Raises when more than
    ``max_count`` arrivals would be produced.
    """
    if rate < 0 or cv <= 0 or end < start:
        raise ValueError(f"bad arrival process: rate={rate} cv={cv} window=[{start}, {end})")
    times: list[float] = []
    if rate == 0:
        return times
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    t = start
    while True:
        gap = rng.expovariate(rate) if cv == 1.0 else rng.gammavariate(shape, scale)
        t += gap
        if t >= end:
            return times
        if len(times) >= max_count:
            raise ValueError(f"more than {max_count} arrivals in [{start}, {end}) at {rate}/s")
        times.append(t)


def arrivals(segments: list[Segment], cv: float, rng: random.Random, max_count: int) -> list[float]:
    """Arrival times over consecutive segments of different rates (a burst is one segment)."""
    times: list[float] = []
    for seg in segments:
        times += gamma_arrivals(seg.rate, cv, seg.start, seg.end, rng, max_count - len(times))
    return times
