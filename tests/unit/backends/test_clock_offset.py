"""A backend's clock from its Date header (proxy.backends.clock_offset)."""

from __future__ import annotations

import email.utils
import logging

import pytest

from proxy.backends.clock_offset import (
    WARN_EVERY_S,
    OffsetWarnings,
    correction,
    date_offset,
)
from tests.helpers.clock import FakeClock

NOW = 1_800_000_000.25


@pytest.mark.parametrize("skew", [-3600.0, -10.0, 0.0, 7.0, 86400.0])
def test_the_offset_is_read_within_half_a_second(skew: float) -> None:
    header = email.utils.formatdate(NOW + skew, usegmt=True)
    offset = date_offset(header, NOW)
    assert offset is not None and abs(offset - skew) <= 0.5


@pytest.mark.parametrize("header", [None, "", "yesterday", "Tue, 01 Dec 2026 99:00:00"])
def test_no_usable_date_is_no_offset(header: str | None) -> None:
    assert date_offset(header, NOW) is None


def test_small_offsets_are_resolution_not_skew() -> None:
    assert correction(0.6) == 0.0 and correction(-0.9) == 0.0
    assert correction(-10.2) == -10.2 and correction(1.0) == 1.0


def test_a_skew_past_the_plugins_allowance_is_warned_about_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    warnings = OffsetWarnings(clock)
    with caplog.at_level(logging.WARNING, logger="tierproxy.monitor"):
        warnings.saw("a", 4.9)  # within the plugin's default 5 s: quiet
        for _ in range(10):
            warnings.saw("a", -12.0)
        warnings.saw("b", 30.0)
        clock.advance(WARN_EVERY_S)
        warnings.saw("a", -12.0)
    texts = [r.getMessage() for r in caplog.records]
    assert len(texts) == 3, texts
    assert "12.0 s behind" in texts[0] and "30.0 s ahead" in texts[1]
