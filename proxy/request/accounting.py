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
    if not charge_usage(adm, result, metrics, child, queue) and result.outcome != Outcome.OK:
        # Nothing was generated that we know of: give back the estimate charged at dispatch.
        queue.correct_charge(adm.queued, 0.0)


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
        if result is None and adm.queued.charged:  # dispatched, then a 504 or a retry's end
            queue.correct_charge(adm.queued, 0.0)  # billed nothing: its estimate taken back
        return False
    child(metrics.tokens, adm.tier, "prompt").inc(counts.prompt)
    child(metrics.tokens, adm.tier, "completion").inc(counts.completion)
    child(metrics.tokens, adm.tier, "cached_prompt").inc(counts.cached)
    queue.correct_charge(adm.queued, adm.work(counts))
    return True
