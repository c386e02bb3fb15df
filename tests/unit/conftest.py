"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest

from tests.clock import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
