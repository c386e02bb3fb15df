"""What the tier scheduler did, counted, and logged every ``TIERPROXY_PLUGIN_STATS_INTERVAL_S``
when it changed (into vLLM's log, under the scheduler's logger)."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

# A child of vLLM's logger, so lines land in vLLM's log with its format.
logger = logging.getLogger("vllm.tierproxy.scheduler")


@dataclass
class PluginCounters:
    """What the plugin did; logged every ``TIERPROXY_PLUGIN_STATS_INTERVAL_S`` when it changes."""

    preemptions: int = 0  # running requests preempted for a better-tier waiting one
    preemptions_refused: int = 0  # wanted a victim, all candidates at their preemption bound
    prefill_tokens_deferred: int = 0  # worse-tier prefill tokens held back by the share cap
    capped_steps: int = 0
    deadline_drops_waiting: int = 0  # never ran (or waited preempted) past the deadline
    deadline_drops_running: int = 0  # stopped mid-generation

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class CountersLog:
    """Logs the counters at most once an interval, and only when they changed since."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._logged_at = time.monotonic()
        self._logged: dict[str, int] = {}

    def maybe_log(self, counters: PluginCounters) -> None:
        now = time.monotonic()
        if now - self._logged_at < self._interval_s:
            return
        self._logged_at = now
        current = counters.as_dict()
        if current != self._logged:
            self._logged = current
            logger.info("tierproxy counters: %s", " ".join(f"{k}={v}" for k, v in current.items()))
