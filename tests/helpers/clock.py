"""The one fake clock of the unit tests: time moves only when a test moves it."""

from __future__ import annotations


class FakeClock:
    """A monotonic clock for injection (``clock=fake``); starts away from 0 so that arithmetic
    on "no time yet" defaults cannot pass by accident."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a monotonic clock does not go back")
        self.now += seconds
        return self.now
