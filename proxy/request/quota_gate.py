"""The tenant's quotas and budget on the request's path (``quota:``, ``pricing:``): the worst
case reserved before the request runs (refused with 429 ``quota_exceeded`` /
``budget_exceeded`` when a counter would pass its limit; never waited for), settled when it
ends to what the usage log records for it: the backend's usage, or what a cut stream delivered,
or nothing when no answer came (refused, timed out, every backend failed)."""

from __future__ import annotations

import time
from collections.abc import Callable

from proxy.api.quota_errors import quota_refused
from proxy.api.usage import cached_tokens
from proxy.config.quotas import price_of
from proxy.config.tenants import quota_of
from proxy.relay.forward import RelayResult
from proxy.request.admitted import Admitted
from proxy.scheduling.quotas import QuotaAsk, QuotaBook, QuotaLedger
from proxy.telemetry.metrics import ProxyMetrics


class QuotaGate:
    def __init__(
        self,
        book: QuotaBook | None = None,
        *,
        wall: Callable[[], float] = time.time,
        metrics: ProxyMetrics | None = None,
    ) -> None:
        self.book: QuotaBook = book if book is not None else QuotaLedger()
        self.wall = wall  # periods are calendar days and months: a wall clock, UTC
        self.metrics = metrics

    async def reserve(self, adm: Admitted) -> None:
        """Reserve the request's worst case on its tenant's quotas, or refuse it."""
        quota = quota_of(adm.tenant, adm.config.tiers[adm.tier])
        limits = quota.limits() if quota is not None else {}
        if not limits:
            return
        price = price_of(adm.config.pricing, adm.parsed.model)
        parsed = adm.parsed
        # The prompt's upper bound, not its estimate: settled to the real usage at the end.
        prompt = parsed.prompt_upper_bound
        cost = price.worst_case(prompt, parsed.expected_output) if price else 0.0
        ask = QuotaAsk(adm.tenant.name, limits, adm.quota_tokens, cost)
        verdict = await self.book.reserve(ask, self.wall())
        if verdict.hold is None:
            if self.metrics is not None:
                self.metrics.rate_limited.labels(adm.tenant.name, verdict.which).inc()
            raise quota_refused(
                verdict.which, verdict.limit, verdict.used, verdict.asked, verdict.retry_after_s
            )
        adm.quota_hold = verdict.hold

    def settle(self, adm: Admitted, result: RelayResult | None) -> None:
        """Once per request (the pipeline's finally): the reservation corrected to its usage."""
        hold, adm.quota_hold = adm.quota_hold, None
        if hold is None:
            return
        counts, _ = adm.billed_usage(result)
        if counts is None:
            self.book.settle(hold, 0.0, 0.0)
            return
        price = price_of(adm.config.pricing, adm.parsed.model)
        cached = cached_tokens(result.usage if result is not None else None)
        cost = price.cost(counts.prompt, cached, counts.completion) if price else 0.0
        self.book.settle(hold, float(counts.total), cost)
