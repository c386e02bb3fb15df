"""The best tier's wait for KV memory, for ``backends: kv_aware``.

Stock vLLM admits a waiting request only when its prompt's blocks can be allocated: on a
backend whose cache the requests in flight fill, a new request waits until one of them has
written its whole answer and freed its blocks. That wait is decode steps, not prefill: one
answer of a few dozen tokens takes as long as the prefill of hundreds or thousands. The
overflow term (``kvterms.kv_overflow``) prices the KV memory in tokens of prefill saved, which
is what the worse tiers (and the bill) care about; for the best tier the wait itself is the
cost. So a best-tier request that would overfill a backend's cache, while another candidate
would admit it now, pays ``WAIT_TOKENS`` of prefill more there (``s95022``: its tenant's turn
waited 270 ms behind another tenant's answer at home, for 30 ms of prefill saved; best-tier
TTFT p99 2.8x the better baseline's).

Only while the best tier is under ``MINORITY`` of the work sent lately (each request weighed by
the prompt blocks it fills, as the balance rule's shares: a cached repeat or a one-line prompt
takes no vote, so a trickle of them cannot switch the wait off for the tier's other tenants;
red team, 2026-12-05): priority means something only for the few. Where the best tier is most
of the traffic (``s32029``: two tenants, three conversations each, all of them the best tier
present), every turn's wait is everyone's, and moving turns off their homes only computed
their histories again (1.01 → 1.07x the better baseline's prefill, its tail unchanged).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from proxy.policies.kvrecent import DecayingCounts

# Tokens of prefill a best-tier request's wait for KV memory costs: about one answer's decode
# on the simulator's calibrated CPU engine. 500 held across the family (docs/benchmarks.md);
# 1,000 moved turns whose system prompt alone was longer (``s94050``: 0.95 -> 1.06).
WAIT_TOKENS = 500.0
# The best tier's share of the prompt blocks filled lately under which its wait counts.
MINORITY = 0.5


class KvWait:
    """Which tier is best, and how much of the work it is lately (decaying over ``tau_s``;
    judged once ``at_least`` requests that filled blocks were sent)."""

    def __init__(
        self,
        latency_weights: Mapping[str, float],
        tau_s: float,
        at_least: float,
        clock: Callable[[], float],
    ) -> None:
        best = max(latency_weights.values(), default=1.0)
        self._best = frozenset(t for t, w in latency_weights.items() if w >= best)
        self._sent = DecayingCounts(tau_s, clock)  # tier -> prompt blocks filled lately
        self.at_least = at_least

    def sent(self, tier: str, filled: float) -> None:
        """A request of ``tier`` sent, filling ``filled`` prompt blocks (0: no vote)."""
        self._sent.add(tier, filled)

    def unsent(self, tier: str, at: float, filled: float) -> None:
        """Undo a ``sent`` made at ``at`` (a request the engine did not run)."""
        self._sent.remove(tier, filled, at)

    def tokens(self, tier: str, fits_somewhere: bool) -> float:
        """The tokens of prefill that waiting for KV memory costs a request of ``tier``
        (``fits_somewhere``: a candidate would admit it now, beside its requests in flight);
        0 for the worse tiers, and while the best tier is most of the traffic."""
        if tier not in self._best or not fits_somewhere:
            return 0.0
        share = self._sent.shares(at_least=self.at_least).get(tier, 0.0)
        return WAIT_TOKENS if share < MINORITY else 0.0
