"""The tenant's per-minute limits on the request's path (``requests_per_minute``,
``tokens_per_minute``, ``max_concurrent``): taken before the queue, waited for within the tier's
queue timeout where the tenant's ``on_limit`` says so, refused with 429 and the exact wait
otherwise; settled to what the request really used once it ends."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from proxy.api.errors import config_changed, over_token_limit, queue_full, rate_limited
from proxy.relay.result import RelayResult
from proxy.request.admitted import Admitted
from proxy.scheduling.limits import TenantLimits
from proxy.scheduling.queue import AdmissionQueue, UnknownTier
from proxy.telemetry.metrics import ProxyMetrics


async def pass_tenant_limits(
    adm: Admitted,
    limits: TenantLimits,
    metrics: ProxyMetrics,
    queue: AdmissionQueue,
    clock: Callable[[], float],
    sleep: Callable[[float], Awaitable[None]],
    retry_after: Callable[[str], float],
) -> None:
    """Take the tenant's rate and concurrency allowance, or wait for it (``on_limit: queue``,
    within the tier's queue timeout), or refuse with 429 and the exact wait."""
    tenant = adm.tenant
    cap = tenant.tokens_per_minute
    if cap is not None and adm.reserved_tokens > cap:
        # Bigger than the whole bucket: once the bucket is full, it would pass and run
        # tokens_per_minute many times over (a prompt list of 200, max_tokens 2048).
        metrics.rate_limited.labels(tenant.name, "tokens_per_minute").inc()
        raise over_token_limit(cap, adm.reserved_tokens)
    give_up_at = adm.arrival + adm.config.tiers[adm.tier].queue_timeout_s
    while True:
        verdict = await limits.admit(tenant.name, adm.reserved_tokens, clock())
        if verdict.allowed:
            adm.limit_hold, adm.limit_windows = verdict.hold, verdict.windows
            return
        metrics.rate_limited.labels(tenant.name, verdict.limit).inc()
        wait = verdict.retry_after_s
        if tenant.on_limit != "queue" or clock() + wait > give_up_at:
            raise rate_limited(verdict.limit, wait)
        if adm.spans is not None:
            adm.spans.limit_wait(verdict.limit, clock())
        # A request waiting for its tenant's limit holds its body like a queued one: it
        # counts against the tier's queue cap.
        try:
            waits = queue.begin_limit_wait(adm.tier)
        except UnknownTier:
            raise config_changed() from None
        if not waits:
            raise queue_full(adm.tier, retry_after(adm.tier))
        try:  # not a network wait: the bucket refills on the clock (or a slot frees)
            await sleep(min(wait, 0.25) if verdict.limit == "max_concurrent" else wait)
        finally:
            queue.end_limit_wait(adm.tier)


def settle_tenant_limits(
    adm: Admitted, result: RelayResult | None, limits: TenantLimits, now: float
) -> None:
    """Charge the tenant's token limit what the request really used: the unused part of the
    reservation comes back, usage past it is debited (the next requests wait for it)."""
    counts, _ = adm.billed_usage(result)
    used = float(counts.total) if counts is not None else None
    limits.settle(adm.tenant.name, adm.reserved_tokens, used, now, adm.limit_hold)
