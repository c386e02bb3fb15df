"""Per-tenant usage, for the teams that pay for the GPUs: Prometheus counters by tenant, tier,
model and outcome, and one usage-log line per finished request.

Label values are bounded by the config: tenants and tiers it names, models the configured
backends serve; anything else (a tenant a reload removed, a model no backend lists) is folded
into ``other``, and ``-`` stands for "not known" (refused before its body was read). Requests
that never authenticated bill nobody and are not counted here.

``queue_s`` runs from arrival to the upstream call that answered (tenant-limit wait, the tier's
queue, failed attempts on other backends); ``engine_s`` from that call to the end of the answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import orjson
from prometheus_client import CollectorRegistry, Counter

from proxy.api.usage import token_usage
from proxy.config.schema import Config
from proxy.relay.result import UPSTREAM_STARTED, RelayResult
from proxy.request.admitted import ESTIMATES
from proxy.request.billing import Billed, billed_as
from proxy.telemetry.adapter_metrics import AdapterMetrics

if TYPE_CHECKING:
    from proxy.request.admitted import Admitted, Trace

log = logging.getLogger("tierproxy")

OTHER = "other"
UNKNOWN = "-"
_LABELS = ["tenant", "tier", "model", "outcome"]


class UsageCounters:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            "tierproxy_usage_requests", "Finished requests per tenant", _LABELS, registry=r
        )
        self.tokens = Counter(
            "tierproxy_usage_tokens",
            "Tokens per tenant by kind (prompt | completion | cached_prompt: of the prompt,"
            " what hit the backend's prefix cache), from the backends' usage",
            [*_LABELS, "kind"],
            registry=r,
        )
        self.queue_seconds = Counter(
            "tierproxy_usage_queue_seconds",
            "Seconds per tenant from arrival to the upstream call that answered",
            _LABELS,
            registry=r,
        )
        self.engine_seconds = Counter(
            "tierproxy_usage_engine_seconds",
            "Seconds per tenant from the upstream call to the end of the answer",
            _LABELS,
            registry=r,
        )
        self.log_dropped = Counter(
            "tierproxy_usage_log_dropped",
            "Usage-log lines dropped (the writer's queue was full, or the disk failed)",
            registry=r,
        )


@dataclass(frozen=True)
class UsageRecord:
    """One line of the usage log."""

    ts: float  # wall-clock time the request finished (Unix seconds)
    request_id: str
    tenant: str
    tier: str
    model: str | None
    backend: str | None
    status: int
    outcome: str
    prompt_tokens: int
    completion_tokens: int
    queue_s: float
    engine_s: float
    duration_s: float
    # The tokens are the proxy's estimate, not the backend's usage (never below what the
    # engine ran); usage_basis says which (proxy.request.admitted.Admitted.billed_usage):
    # backend | delivered | reservation | client_left | none.
    usage_estimated: bool = False
    usage_basis: str = "none"
    client_request_id: str | None = None  # the client's X-Request-Id, beside the proxy's own
    # Of prompt_tokens, those vLLM found in its prefix cache (vLLM's
    # --enable-prompt-tokens-details; 0 without it).
    cached_prompt_tokens: int = 0
    cost: float | None = None  # by `pricing:` (the config it was admitted under); None: no price
    key_id: str = "-"  # which of the tenant's keys (the start of its sha256, as `keys list`)
    # What the proxy's prefix-cache index predicted of cached_prompt_tokens when it dispatched
    # the request (kv_cache on; null: no prediction): equal to it when the index is exact.
    predicted_cached_tokens: int | None = None
    adapter: str | None = None  # the LoRA adapter of `adapters:` it ran (its model); null: none

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))


class UsageMeter:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        config: Callable[[], Config],
        models: Callable[[], set[str]],
        clock: Callable[[], float],
        wall: Callable[[], float] = time.time,
        sink: Callable[[bytes], object] | None = None,
        adapters: AdapterMetrics | None = None,
    ) -> None:
        self.counters = UsageCounters(registry)
        self.adapters = adapters  # per-adapter requests and tokens
        self.config = config
        self.models = models  # what the configured backends serve
        self.clock = clock
        self.wall = wall
        self.sink = sink  # the usage log's writer
        self._names: tuple[Config | None, frozenset[str]] = (None, frozenset())
        # The live view's per-tenant totals: a plain dict, cheaper to read than the counters.
        self.tokens_by_tenant: dict[tuple[str, str], float] = {}

    def finished(self, trace: Trace, adm: Admitted | None, result: RelayResult | None) -> None:
        """The pipeline's last step for every request, whatever it ended in."""
        if trace.tenant is None:
            return
        try:
            self._count(trace, adm, result)
        except Exception:  # a bug here must not turn an answered request into a 500
            log.exception("usage accounting failed for request %s", trace.request_id)

    def _count(self, trace: Trace, adm: Admitted | None, result: RelayResult | None) -> None:
        record = self.record(trace, adm, result)
        labels = self.bounded(record)
        c = self.counters
        c.requests.labels(*labels).inc()
        if record.prompt_tokens:
            c.tokens.labels(*labels, "prompt").inc(record.prompt_tokens)
        if record.completion_tokens:
            c.tokens.labels(*labels, "completion").inc(record.completion_tokens)
        if record.cached_prompt_tokens:
            c.tokens.labels(*labels, "cached_prompt").inc(record.cached_prompt_tokens)
        used = record.prompt_tokens + record.completion_tokens
        if used:
            key = labels[:2]
            self.tokens_by_tenant[key] = self.tokens_by_tenant.get(key, 0.0) + used
        c.queue_seconds.labels(*labels).inc(record.queue_s)
        c.engine_seconds.labels(*labels).inc(record.engine_s)
        if record.adapter is not None and self.adapters is not None:
            out = record.completion_tokens
            self.adapters.finished(record.adapter, record.outcome, record.prompt_tokens, out)
        if self.sink is not None:
            self.sink(record.to_json())

    def record(self, trace: Trace, adm: Admitted | None, result: RelayResult | None) -> UsageRecord:
        assert trace.tenant is not None
        end = self.clock()
        if adm is not None:
            counts, basis = adm.billed_usage(result)
        else:
            counts = token_usage(result.usage if result is not None else None)
            basis = "backend" if counts is not None else "none"
        estimated = basis in ESTIMATES
        started = result.extra.get(UPSTREAM_STARTED) if result is not None else None
        queue_end = started if isinstance(started, float) else end
        # Billed as the quota gate priced it at admission (the backends' default model for a
        # request without one); a request refused before that, as it named.
        billed = adm.billed if adm is not None else Billed(None, None)
        if billed.model is None and billed.price is None:
            pricing = (adm.config if adm is not None else self.config()).prices
            billed = billed_as(adm.parsed.model if adm is not None else None, pricing, ())
        model, price = billed.model, billed.price
        catalogue = (adm.config if adm is not None else self.config()).adapters
        cached = counts.cached if counts is not None else 0  # the bill's own (Delivered.usage too)
        prompt = counts.prompt if counts is not None else 0
        completion = counts.completion if counts is not None else 0
        return UsageRecord(
            ts=self.wall(),
            request_id=trace.request_id,
            key_id=trace.key_id,
            tenant=trace.tenant.name,
            tier=trace.tenant.tier,
            model=model,
            backend=_backend_of(adm) if result is not None or estimated else None,
            status=trace.status,
            outcome=str(trace.outcome),
            prompt_tokens=prompt,
            completion_tokens=completion,
            queue_s=max(0.0, queue_end - trace.arrival),
            engine_s=max(0.0, end - queue_end),
            duration_s=max(0.0, end - trace.arrival),
            usage_estimated=estimated,
            usage_basis=basis,
            client_request_id=trace.client_request_id,
            cached_prompt_tokens=min(cached, prompt),
            predicted_cached_tokens=_predicted(adm),
            cost=round(price.cost(prompt, cached, completion), 9) if price is not None else None,
            adapter=model if model is not None and model in catalogue else None,
        )

    def bounded(self, record: UsageRecord) -> tuple[str, str, str, str]:
        """The record's label values, folded into the set the config allows."""
        cfg = self.config()
        if self._names[0] is not cfg:  # once per config, not per request (10,000 tenants)
            self._names = (cfg, frozenset(t.name for t in cfg.tenants))
        tenant = record.tenant if record.tenant in self._names[1] else OTHER
        tier = record.tier if record.tier in cfg.tiers else OTHER
        model = record.model
        if model is None:
            model = UNKNOWN
        elif model not in self.models() and model not in cfg.adapters:
            model = OTHER
        return tenant, tier, model, record.outcome


def _predicted(adm: Admitted | None) -> int | None:
    blocks = adm.queued.predicted_blocks if adm is not None else None
    if adm is None or blocks is None:
        return None
    return blocks * adm.config.kv_cache.block_size


def _backend_of(adm: Admitted | None) -> str | None:
    """The backend of the request's last lease (the one that answered)."""
    waiter = adm.queued.waiter if adm is not None else None
    if waiter is None or not waiter.done() or waiter.cancelled() or waiter.exception():
        return None
    label: str = waiter.result().backend.label
    return label
