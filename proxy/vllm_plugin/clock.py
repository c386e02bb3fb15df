"""Clock trouble between the proxy's host and this one, made loud.

The only cross-host comparison left in the ticket is its validity window (``issued_at``
within ``TIERPROXY_TICKET_MAX_SKEW_S`` ahead, ``TIERPROXY_TICKET_WINDOW_S`` behind). A ticket
outside it is not trusted: the request runs unticketed at the lowest priority (or is refused
with ``TIERPROXY_REQUIRE_TICKET``), which for a proxy whose clock runs ahead means *every*
request. That must not pass silently: each such refusal is counted in
``tierproxy_plugin_ticket_clock_refusals_total{reason}`` (on vLLM's ``/metrics``) and logged at
WARNING with the offset seen, at most once per ``WARN_EVERY_S`` (a flood of requests must not
flood the log).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import Counter

logger = logging.getLogger("vllm.tierproxy.middleware")

WARN_EVERY_S = 60.0

# One per process (vLLM's default registry serves it): the middleware may be built more than
# once (tests, several apps), the metric only once.
CLOCK_REFUSALS = Counter(
    "tierproxy_plugin_ticket_clock_refusals",
    "Tickets refused because their issued_at lies outside this host's validity window:"
    " reason=future (the proxy's clock ahead by more than the allowed skew) or expired (behind"
    " by more than the window, or an upload that slow)",
    ["reason"],
)


class ClockWatch:
    """Counts and reports tickets refused for their time; rate-limited warnings."""

    def __init__(
        self,
        *,
        window_s: float,
        max_skew_s: float,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.max_skew_s = max_skew_s
        self._monotonic = monotonic
        self._warned_at: float | None = None
        self._unreported = 0  # refusals since the last warning

    def refused(self, reason: str, issued_at: float, now: float) -> None:
        """A ticket issued at ``issued_at`` (the proxy's clock) was refused at ``now`` (ours);
        ``reason``: "future" or "expired"."""
        CLOCK_REFUSALS.labels(reason).inc()
        self._unreported += 1
        at = self._monotonic()
        if self._warned_at is not None and at - self._warned_at < WARN_EVERY_S:
            return
        self._warned_at = at
        count, self._unreported = self._unreported, 0
        offset = issued_at - now
        if reason == "future":
            why = (
                f"issued {offset:.1f} s ahead of this host's clock (allowed skew"
                f" {self.max_skew_s:g} s): the proxy's clock runs ahead"
            )
        else:
            why = (
                f"issued {-offset:.1f} s ago (window {self.window_s:g} s): the proxy's clock"
                " runs behind, or the request took that long to arrive"
            )
        logger.warning(
            "tierproxy: %d ticket(s) refused for their time since the last such warning, the"
            " latest %s; such requests run unticketed at the lowest priority (or are refused"
            " with TIERPROXY_REQUIRE_TICKET). Synchronise the clocks (NTP) of the proxy and"
            " vLLM hosts.",
            count,
            why,
        )
