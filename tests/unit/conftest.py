"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest

from tests.helpers.clock import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
