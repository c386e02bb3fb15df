"""What a finished request is charged on the proxy's own meters: its time to first token, its
tokens by tier, and the fairness charge corrected from the estimate to the usage billed
(``Admitted.billed_usage``: the backend's, or what a cut stream delivered)."""

from __future__ import annotations

from proxy.api.hotpath import LabelCache
from proxy.api.outcome import Outcome
from proxy.api.routes import BY_ENDPOINT
from proxy.relay.result import RelayResult
from proxy.request.admitted import Admitted
from proxy.scheduling.queue import AdmissionQueue
from proxy.telemetry.metrics import ProxyMetrics


def account(
    adm: Admitted,
    result: RelayResult,
    metrics: ProxyMetrics,
    child: LabelCache,
    queue: AdmissionQueue,
) -> None:
    """Metrics of the answer, and the fairness charge corrected to the real usage."""
    if BY_ENDPOINT[adm.parsed.endpoint].cheap:
        return  # never queued: no fairness charge to correct, no tokens
    if result.first_token_at is not None:
        child(metrics.ttft, adm.tier).observe(result.first_token_at - adm.arrival)
    charge_usage(adm, result, metrics, child, queue)


def charge_usage(
    adm: Admitted,
    result: RelayResult | None,
    metrics: ProxyMetrics,
    child: LabelCache,
    queue: AdmissionQueue,
) -> bool:
    """Token metrics and the fairness charge from the usage billed; False when there is none."""
    counts, _ = adm.billed_usage(result)
    if counts is None:
        # Nothing generated that is known of (a failure, a 504, a client gone before a
        # backend took it): the estimates charged at its dispatches are given back. An answer
        # that came whole without usage keeps them.
        if adm.queued.charged and (result is None or result.outcome != Outcome.OK):
            queue.correct_charge(adm.queued, 0.0)
        return False
    child(metrics.tokens, adm.tier, "prompt").inc(counts.prompt)
    child(metrics.tokens, adm.tier, "completion").inc(counts.completion)
    child(metrics.tokens, adm.tier, "cached_prompt").inc(counts.cached)
    queue.correct_charge(adm.queued, adm.work(counts))
    return True
