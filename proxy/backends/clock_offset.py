"""A backend's clock against this host's, read from the HTTP ``Date`` header of its answers.

The ticket's ``issued_at`` is the one time the plugin compares with its own host's clock (its
validity window, docs/plugin.md "Clocks"). A proxy whose clock runs ahead of an engine host's by
more than the plugin's allowed skew had every ticket refused there. The monitor measures each
backend's offset on its periodic ``/metrics`` probe and the proxy stamps ``issued_at`` on that
backend's clock. ``Date`` has whole seconds: the estimate is the middle of that second, within
about half a second plus the probe's round trip, so smaller offsets are left alone.
"""

from __future__ import annotations

import email.utils
import logging
import math
import time
from collections.abc import Callable

log = logging.getLogger("tierproxy.monitor")

# Below it an offset is Date's resolution and the round trip, not a clock apart: no correction.
MIN_CORRECTION_S = 1.0
# The plugin's default TIERPROXY_TICKET_MAX_SKEW_S: beyond it uncorrected tickets were refused.
WARN_BEYOND_S = 5.0
WARN_EVERY_S = 600.0  # per backend


def date_offset(date_header: str | None, received_at: float) -> float | None:
    """The backend's clock minus ours, in seconds: its ``Date`` (mid-second) against our epoch
    time when the answer arrived. None without a usable header."""
    if not date_header:
        return None
    try:
        when = email.utils.parsedate_to_datetime(date_header)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    offset = when.timestamp() + 0.5 - received_at
    return offset if math.isfinite(offset) else None


def correction(offset_s: float) -> float:
    """What to add to this host's time to stamp a ticket on the backend's clock."""
    return offset_s if abs(offset_s) >= MIN_CORRECTION_S else 0.0


class OffsetWarnings:
    """A WARNING when a backend's clock is further apart than the plugin allows, at most once
    per ``WARN_EVERY_S`` per backend."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._warned_at: dict[str, float] = {}

    def saw(self, backend: str, offset_s: float) -> None:
        if abs(offset_s) <= WARN_BEYOND_S:
            return
        now = self._monotonic()
        last = self._warned_at.get(backend)
        if last is not None and now - last < WARN_EVERY_S:
            return
        self._warned_at[backend] = now
        log.warning(
            "backend %s: its clock is %.1f s %s this host's (from its Date header); tickets"
            " for it are stamped on its clock so that its plugin accepts them, but fix the"
            " clocks (NTP): the gauge tierproxy_backend_clock_offset_seconds follows it",
            backend,
            abs(offset_s),
            "ahead of" if offset_s > 0 else "behind",
        )
