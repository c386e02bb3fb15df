"""Error lines of a backend's background task, throttled: a hostile or broken backend cannot
flood the log."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

_LOG_EVERY_S = 60.0  # one error line per backend and kind at most, with a count of the rest


class Throttled:
    """A log line at most every ``_LOG_EVERY_S`` (a hostile backend cannot flood the log)."""

    def __init__(self, log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.clock = clock
        self._next = 0.0
        self._quiet = 0

    def __call__(self, level: int, msg: str, *args: object, exc: bool = False) -> None:
        now = self.clock()
        if now < self._next:
            self._quiet += 1
            return
        self._next = now + _LOG_EVERY_S
        quiet, self._quiet = self._quiet, 0
        suffix = f" ({quiet} more since the last line)" if quiet else ""
        self.log.log(level, msg + suffix, *args, exc_info=exc)
