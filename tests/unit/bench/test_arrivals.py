"""Arrival processes with a seeded RNG: rates, burstiness, bounds, determinism."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from proxy.bench.arrivals import Segment, arrivals, gamma_arrivals, poisson_arrivals


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def test_poisson_rate_and_cv() -> None:
    times = poisson_arrivals(50.0, 0.0, 200.0, random.Random(7), max_count=100_000)
    assert len(times) == pytest.approx(10_000, rel=0.05)
    g = gaps(times)
    assert statistics.mean(g) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(1.0, abs=0.05)
    assert all(0.0 <= t < 200.0 for t in times)
    assert times == sorted(times)


def test_gamma_is_bursty_with_the_same_mean_rate() -> None:
    times = gamma_arrivals(50.0, 3.0, 0.0, 400.0, random.Random(7), max_count=100_000)
    g = gaps(times)
    assert statistics.mean(g) == pytest.approx(1 / 50, rel=0.1)
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(3.0, rel=0.1)


def test_gamma_below_one_is_regular() -> None:
    g = gaps(gamma_arrivals(10.0, 0.2, 0.0, 500.0, random.Random(3), max_count=100_000))
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(0.2, rel=0.1)


def test_same_seed_same_arrivals() -> None:
    a = gamma_arrivals(5.0, 2.0, 0.0, 30.0, random.Random(11), max_count=1000)
    b = gamma_arrivals(5.0, 2.0, 0.0, 30.0, random.Random(11), max_count=1000)
    c = gamma_arrivals(5.0, 2.0, 0.0, 30.0, random.Random(12), max_count=1000)
    assert a == b
    assert a != c


def test_bounded_in_count() -> None:
    with pytest.raises(ValueError, match="more than 100"):
        poisson_arrivals(1000.0, 0.0, 10.0, random.Random(1), max_count=100)


def test_zero_rate_and_bad_input() -> None:
    assert poisson_arrivals(0.0, 0.0, 10.0, random.Random(1), max_count=10) == []
    with pytest.raises(ValueError):
        poisson_arrivals(-1.0, 0.0, 10.0, random.Random(1), max_count=10)
    with pytest.raises(ValueError):
        gamma_arrivals(1.0, 0.0, 0.0, 10.0, random.Random(1), max_count=10)


def test_segments_make_a_burst() -> None:
    segs = [Segment(0, 20, 2.0), Segment(20, 30, 20.0), Segment(30, 50, 2.0)]
    times = arrivals(segs, 1.0, random.Random(5), max_count=10_000)
    before = sum(1 for t in times if t < 20)
    burst = sum(1 for t in times if 20 <= t < 30)
    after = sum(1 for t in times if t >= 30)
    assert burst == pytest.approx(200, rel=0.2)
    assert before == pytest.approx(40, rel=0.4)
    assert after == pytest.approx(40, rel=0.4)
    assert burst / 10 > 5 * (before / 20)
