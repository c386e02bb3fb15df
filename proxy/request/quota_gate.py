"""The tenant's quotas and budget on the request's path (``quota:``, ``pricing:``): the worst
case reserved before the request runs (refused with 429 ``quota_exceeded`` /
``budget_exceeded`` when a counter would pass its limit; never waited for), settled when it
ends to what the usage log records for it: the backend's usage, or what a cut stream delivered,
or nothing when no answer came (refused, timed out, every backend failed)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from proxy.api.errors import ProxyError
from proxy.api.quota_counters import COUNTERS
from proxy.api.quota_errors import quota_refused, unpriced
from proxy.config.schema import Config
from proxy.config.tenants import Tenant, quota_of
from proxy.relay.forward import RelayResult
from proxy.request.admitted import Admitted
from proxy.request.billing import (
    Card,
    affordable_output,
    billed_as,
    default_models,
    model_context,
)
from proxy.request.route_table import ROWS
from proxy.scheduling.quotas import QuotaAsk, QuotaBook, QuotaLedger, QuotaVerdict
from proxy.telemetry.metrics import ProxyMetrics


def _no_cards() -> Iterable[Sequence[Card]]:
    return ()


def quota_limits(config: Config, tenant: Tenant) -> dict[str, float]:
    """The tenant's quota and budget limits under ``config`` (its own, else its tier's)."""
    quota = quota_of(tenant, config.tiers[tenant.tier])
    return quota.limits() if quota is not None else {}


class QuotaGate:
    def __init__(
        self,
        book: QuotaBook | None = None,
        *,
        wall: Callable[[], float] = time.time,
        metrics: ProxyMetrics | None = None,
        model_cards: Callable[[], Iterable[Sequence[Card]]] = _no_cards,
    ) -> None:
        """``model_cards``: each backend's ``/v1/models`` cards as last probed (the model
        vLLM runs for a request without one, and its context)."""
        self.book: QuotaBook = book if book is not None else QuotaLedger()
        self.wall = wall  # periods are calendar days and months: a wall clock, UTC
        self.metrics = metrics
        self.model_cards = model_cards

    async def reserve(self, adm: Admitted) -> None:
        """Price the request as the model vLLM will run; reserve its worst case on its
        tenant's quotas, or refuse it."""
        parsed = adm.parsed
        defaults = [] if parsed.model is not None else default_models(self.model_cards())
        adm.billed = billed_as(parsed.model, adm.config.prices, defaults)
        limits = quota_limits(adm.config, adm.tenant)
        if not limits:
            return
        price = adm.billed.price
        if price is None and any(COUNTERS[c].money for c in limits):
            raise unpriced(adm.billed.model)
        if parsed.output_upper_bound is None:
            self._bound_output(adm, limits)
        # The prompt's upper bound, not its estimate, and every output token vLLM may make:
        # settled to the real usage at the end.
        prompt, output = (
            parsed.prompt_billed(parsed.prompt_upper_bound),
            parsed.output_upper_bound or 0,
        )
        cost = price.worst_case(prompt, output) if price else 0.0
        ask = QuotaAsk(adm.tenant.name, limits, float(prompt + output), cost)
        verdict = await self.book.reserve(ask, self.wall())
        if verdict.hold is None:
            raise self.refusal(adm.tenant.name, verdict)
        adm.quota_hold = verdict.hold

    def refusal(self, tenant: str, verdict: QuotaVerdict) -> ProxyError:
        """The 429 of a refused reservation (counted in ``tierproxy_rate_limited_total``)."""
        if self.metrics is not None:
            self.metrics.rate_limited.labels(tenant, verdict.which).inc()
        return quota_refused(
            verdict.which, verdict.limit, verdict.used, verdict.asked, verdict.retry_after_s
        )

    def _bound_output(self, adm: Admitted, limits: Mapping[str, float]) -> None:
        """A request with quotas and no output bound gets one, sent on as its max_tokens: the
        model's context (else ``limits.max_tokens_ceiling``), cut to what its tenant's
        remaining quotas still pay for, so that vLLM stops where the budget runs out rather
        than the quota being passed by a whole context."""
        parsed = adm.parsed
        context = model_context(adm.context_model, self.model_cards())
        ceiling = adm.config.limits.max_tokens_ceiling
        bound = min(context, ceiling) if context is not None else ceiling
        used = self.used(adm.tenant.name, limits, self.wall())
        afford = affordable_output(
            limits,
            used,
            prompt=parsed.prompt_billed(parsed.prompt_upper_bound),
            price=adm.billed.price,
            sequences=max(1, parsed.sequences),
        )
        if afford is not None and afford >= 1:
            bound = min(bound, afford)
        parsed.max_tokens = parsed.body[ROWS[parsed.endpoint].budget_fields[0]] = bound

    def used(self, tenant: str, limits: Mapping[str, float], wall: float) -> dict[str, float]:
        """Each counter's use as this replica knows it (with Redis: as last read back, with its
        own corrections since)."""
        report = self.book.usage(tenant, limits, wall)
        return {name: float(entry.get("used", 0.0)) for name, entry in report.items()}

    def settle(self, adm: Admitted, result: RelayResult | None) -> None:
        """Once per request (the pipeline's finally): the reservation corrected to its usage."""
        hold, adm.quota_hold = adm.quota_hold, None
        if hold is None:
            return
        counts, _ = adm.billed_usage(result)
        if counts is None:
            self.book.settle(hold, 0.0, 0.0)
            return
        price = adm.billed.price
        cost = price.cost(counts.prompt, counts.cached, counts.completion) if price else 0.0
        self.book.settle(hold, float(counts.total), cost)
