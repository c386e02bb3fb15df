"""Windowed deltas and rates of cumulative counters (proxy.ops.live.window), on a fake clock."""

from __future__ import annotations

import math

import pytest

from proxy.ops.live.window import CounterWindow, histogram_quantile
from tests.helpers.clock import FakeClock


def test_early_on_the_window_runs_from_creation(clock: FakeClock) -> None:
    window = CounterWindow(60.0, clock)
    clock.advance(10)
    view = window.update({("tokens", "a"): 500.0})
    assert view.span_s == 10
    assert view.delta(("tokens", "a")) == 500 and view.rate(("tokens", "a")) == 50
    assert view.delta(("tokens", "never")) == 0


def test_the_window_slides_past_old_counts(clock: FakeClock) -> None:
    window = CounterWindow(60.0, clock)
    total = 0.0
    for _ in range(120):  # one look a second, 10 tokens a second for 2 minutes...
        clock.advance(1)
        total += 10
        view = window.update({("t",): total})
    assert view.span_s == pytest.approx(60, abs=2)
    assert view.rate(("t",)) == pytest.approx(10)
    for _ in range(30):  # ...then nothing for 30 s: the rate halves, as over the last minute
        clock.advance(1)
        view = window.update({("t",): total})
    assert view.rate(("t",)) == pytest.approx(5, rel=0.05)
    assert len(window._snapshots) <= 32  # bounded, however often it is asked


def test_frequent_looks_keep_few_snapshots(clock: FakeClock) -> None:
    window = CounterWindow(60.0, clock)
    for i in range(10_000):
        clock.advance(0.01)
        window.update({("t",): float(i)})
    assert len(window._snapshots) <= 32


def test_a_vanished_counter_counts_zero_and_never_negative(clock: FakeClock) -> None:
    window = CounterWindow(60.0, clock)
    clock.advance(5)
    window.update({("x",): 10.0})
    clock.advance(61)
    assert window.update({("x",): 4.0}).delta(("x",)) == 0  # not -6


def test_histogram_quantile_interpolates_inside_the_bucket() -> None:
    # 100 observations: 90 under 0.1 s, 10 between 0.1 and 1 s.
    buckets = [(0.1, 90.0), (1.0, 100.0), (math.inf, 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 * 50 / 90)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.1 + 0.9 * 9 / 10)
    assert histogram_quantile(0.99, [(0.1, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.99, []) is None
    # Beyond the last finite bound: that bound (as PromQL answers).
    assert histogram_quantile(0.99, [(0.1, 1.0), (math.inf, 10.0)]) == 0.1
