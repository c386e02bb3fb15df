"""Outlier detection: when a backend is ejected (failed requests, a doubling backoff), marked
down (failed probes) and reinstated (with a ramp, which the room policy applies). Pure logic on
``BackendState``; the monitor and the pipeline report what they saw."""

from __future__ import annotations

from collections.abc import Iterable

from proxy.backends.backend import BackendState
from proxy.config.backends import BackendHealth


class OutlierDetection:
    def __init__(self, health: BackendHealth) -> None:
        self.health = health  # replaced on reload

    def record_failure(self, state: BackendState, now: float, *, definitive: bool = False) -> None:
        """Passive ejection, with a doubling backoff: at once when nothing listens
        (``definitive``), after two failures in a row otherwise (a reset or a 5xx can be one
        request's bad luck)."""
        state.failures += 1
        if state.failing_since is None:
            state.failing_since = now
        if not definitive and state.failures < 2:
            return
        backoff = min(self.health.eject_max_s, self.health.eject_base_s * 2 ** (state.failures - 1))
        state.ejected_until = now + backoff
        state.reinstated_at = None

    def record_success(self, state: BackendState, now: float) -> None:
        if state.failures:
            state.failures = 0
            state.failing_since = None
            state.reinstated_at = now

    def probe_result(self, state: BackendState, ok: bool, now: float) -> None:
        state.probe_failures = 0 if ok else state.probe_failures + 1
        if ok or state.probe_failing_since is None:
            state.probe_failing_since = None if ok else now
        if not ok and state.probe_failures < self.health.unhealthy_after:
            return
        if ok and not state.healthy:
            state.healthy = True
            state.failures, state.failing_since = 0, None
            state.ejected_until = 0.0
            state.reinstated_at = now
        elif ok and self._ejection_over(state, now):
            state.failures, state.failing_since = 0, None
            state.reinstated_at = now
        elif not ok:
            if state.healthy:
                state.reinstated_at = None
            state.healthy = False

    @staticmethod
    def _ejection_over(state: BackendState, now: float) -> bool:
        """Whether the backend's requests failed, it was ejected for it, and the ejection
        ended: a good probe then brings it back. A good probe before any ejection says nothing
        of its requests (a wedged engine answers /health): it left the count of failures in a
        row at one whenever other backends' requests came between, and the backend was never
        ejected (red team)."""
        if not state.failures or state.failing_since is None:
            return False
        return state.failing_since < state.ejected_until <= now


def passed_over(
    states: Iterable[BackendState], failed: frozenset[str], model: str | None, now: float
) -> frozenset[str]:
    """The backends a retry passes over: those it failed on, while another available
    backend serves its model (it waits for that one's slot rather than go back to the
    backend that just failed it, as Envoy's previous-hosts retry predicate does)."""
    if failed and any(
        s.cfg.url not in failed and s.available(now) and s.serves(model) for s in states
    ):
        return failed
    return frozenset()
