"""``/admin/status``: what the proxy holds now and did over the last minute, as JSON.

Instant numbers come from the live state (queues, limits, backends); "over the last minute"
ones from the Prometheus counters through a ``CounterWindow``.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client.metrics import MetricWrapperBase

from proxy.api.outcome import Outcome
from proxy.backends.backend import BackendState
from proxy.config.tenants import Tenant, Tier, quota_of
from proxy.ops.live.window import CounterWindow, Key, WindowView, histogram_quantile
from proxy.policies.kvaware import KvAware

if TYPE_CHECKING:
    from proxy.backends.pool import BackendPool
    from proxy.config.schema import Config
    from proxy.ops.usage import UsageMeter
    from proxy.scheduling.limits import TenantLimits
    from proxy.scheduling.queue import AdmissionQueue
    from proxy.scheduling.quotas import QuotaBook
    from proxy.telemetry.metrics import ProxyMetrics

WINDOW_S = 60.0
# Outcomes that are the proxy saying no (the others are answers, good or bad).
REFUSALS = frozenset(
    {
        Outcome.QUEUE_FULL,
        Outcome.RATE_LIMITED,
        Outcome.QUEUE_TIMEOUT,
        Outcome.UNAVAILABLE,
        Outcome.REJECTED,
        Outcome.TIMEOUT,
    }
)


def backend_state(backend: BackendState, now: float, ramp_s: float) -> str:
    """healthy | ramping (back from an ejection, room growing) | ejected | down | draining."""
    if backend.draining:
        return "draining"
    if not backend.healthy:
        return "down"
    if now < backend.ejected_until:
        return "ejected"
    if backend.reinstated_at is not None and now - backend.reinstated_at < ramp_s:
        return "ramping"
    return "healthy"


def _samples(metric: MetricWrapperBase, suffix: str) -> Iterable[tuple[dict[str, str], float]]:
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith(suffix):
                yield sample.labels, sample.value


class LiveStatus:
    """Reads the live objects it is handed (the server owns them; they keep their identity
    across reloads, the config is read anew each time)."""

    def __init__(
        self,
        *,
        config: Callable[[], Config],
        queue: AdmissionQueue,
        limits: TenantLimits,
        pool: BackendPool,
        metrics: ProxyMetrics,
        usage: UsageMeter,
        clock: Callable[[], float],
        window_s: float = WINDOW_S,
        quotas: QuotaBook | None = None,
    ):
        self.config, self.queue, self.limits, self.pool = config, queue, limits, pool
        self.metrics, self.usage, self.clock = metrics, usage, clock
        self.window = CounterWindow(window_s, clock)
        self.wall: Callable[[], float] = time.time
        self.quotas = quotas

    def totals(self) -> dict[Key, float]:
        """The counters the window follows, flattened to one key each."""
        m, out = self.metrics, defaultdict[Key, float](float)
        for labels, value in _samples(m.queue_wait, "_bucket"):
            out["wait", labels["tier"], labels["le"]] += value
        for labels, value in _samples(m.requests, "_total"):
            out["requests", labels["tier"], labels["outcome"]] += value
        for labels, value in _samples(m.rate_limited, "_total"):
            out["limited", labels["tenant"], labels["limit"]] += value
        for (tenant, tier), value in self.usage.tokens_by_tenant.items():
            out["tokens", tenant, tier] = value
        return dict(out)

    def snapshot(self, max_tenants: int = 100) -> dict[str, Any]:
        view = self.window.update(self.totals())
        tenants = self.tenants(view)
        return {
            "at": self.wall(),
            "window_s": round(view.span_s, 3),
            "tiers": self.tiers(view, tenants),
            "tenants": tenants[:max_tenants],
            "tenants_active": len(tenants),
            "backends": self.backends(),
            "kv_placement": self.kv_placement(),
        }

    def tiers(self, view: WindowView, tenants: list[dict[str, Any]]) -> list[dict[str, Any]]:
        cfg, queue = self.config(), self.queue
        out = []
        for name, tier in sorted(cfg.tiers.items(), key=lambda kv: kv[1].priority):
            buckets = [
                (float(k[2]), v) for k, v in view.deltas.items() if k[0] == "wait" and k[1] == name
            ]
            finished = {
                k[2]: v for k, v in view.deltas.items() if k[0] == "requests" and k[1] == name
            }
            p99 = histogram_quantile(0.99, buckets)
            mine = [t for t in tenants if t["tier"] == name]
            out.append(
                {
                    "name": name,
                    "priority": tier.priority,
                    "weight": tier.weight,
                    "depth": queue.depth(name),
                    "max_queue": tier.max_queue,
                    "limit_waiting": queue.limit_waiting(name),
                    "running": sum(t["running"] for t in mine),
                    "wait_p99_s": round(p99, 4) if p99 is not None else None,
                    "finished": round(sum(finished.values())),
                    "refused": {o: round(v) for o, v in sorted(finished.items()) if o in REFUSALS},
                    "tokens_per_s": round(sum(t["tokens_per_s"] for t in mine), 2),
                }
            )
        return out

    def tenants(self, view: WindowView) -> list[dict[str, Any]]:
        """Tenants that queue, run, used tokens or hit a limit in the window; busiest first."""
        queued = Counter(r.tenant for r in self.queue.queued())
        limits_hit: dict[str, dict[str, int]] = {}
        for key, value in view.deltas.items():
            if key[0] == "limited" and value:
                limits_hit.setdefault(key[1], {})[key[2]] = round(value)
        tokens = {k[1:]: v for k, v in view.deltas.items() if k[0] == "tokens" and v}
        concurrent = self.limits.concurrent
        rows: list[dict[str, Any]] = []
        cfg, wall = self.config(), self.wall()
        for tenant in cfg.tenants:  # 10,000 tenants: a few ms, so little per tenant
            name = tenant.name
            active = concurrent(name)  # admitted, not yet finished (queued too)
            used = tokens.get((name, tenant.tier), 0.0)
            if not (active or used or name in queued or name in limits_hit):
                continue
            rows.append(
                {
                    "name": name,
                    "tier": tenant.tier,
                    "weight": tenant.weight,
                    "queued": queued[name],
                    "running": max(0, active - queued[name]),
                    "tokens_per_s": round(used / view.span_s, 2) if view.span_s > 0 else 0.0,
                    "limits": {
                        "requests_per_minute": tenant.requests_per_minute,
                        "tokens_per_minute": tenant.tokens_per_minute,
                        "max_concurrent": tenant.max_concurrent,
                    },
                    "limits_hit": limits_hit.get(name, {}),
                    "quota": self.quota_of(tenant, cfg.tiers[tenant.tier], wall),
                    "_tokens": used,
                }
            )
        _shares(rows)
        rows.sort(key=lambda r: (-r["tokens_per_s"], -(r["running"] + r["queued"]), r["name"]))
        return rows

    def quota_of(self, tenant: Tenant, tier: Tier, wall: float) -> dict[str, Any]:
        """Each quota and budget of the tenant: used in the current UTC period, its limit and
        its reset ({} when it has none)."""
        quota = quota_of(tenant, tier)
        if self.quotas is None or quota is None:
            return {}
        return self.quotas.usage(tenant.name, quota.limits(), wall)

    def kv_placement(self) -> dict[str, Any] | None:
        """kv_aware's memory of where prompts were sent (``proxy.policies.kvmemory``): each
        tenant's kept (backend, block) pairs per backend, and the requests in flight; None
        under another chooser."""
        chooser = self.pool.chooser
        if not isinstance(chooser, KvAware):
            return None
        memory = chooser.memory
        return {
            "capacity": memory.capacity,
            "in_flight": memory.in_flight(),
            "tenants": memory.placement(),
        }

    def backends(self) -> list[dict[str, Any]]:
        pool, now = self.pool, self.clock()
        ramp_s = self.config().backend_health.ramp_s
        out = []
        for b in pool.all():
            load = b.load
            out.append(
                {
                    "name": b.label,
                    "url": b.cfg.url,
                    "state": backend_state(b, now, ramp_s),
                    "room": round(pool.room(b, now), 2),
                    "inflight": b.inflight,
                    "max_inflight": b.cfg.max_inflight,  # null: the room is learned
                    "capacity": round(b.max_room, 1),  # max_inflight, or the learned room
                    "vllm_running": load.running if load else None,
                    "vllm_waiting": load.waiting if load else None,
                    "vllm_kv_usage": round(load.kv_usage, 4) if load else None,
                    "metrics_age_s": round(now - load.at, 2) if load else None,
                }
            )
        return out


def _shares(rows: list[dict[str, Any]]) -> None:
    """Each tenant's share of its tier's tokens in the window, beside its fair share: its
    weight over the weights of the tier's active tenants (what the fairness policy aims at)."""
    by_tier: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_tier.setdefault(row["tier"], []).append(row)
    for members in by_tier.values():
        tokens = sum(r["_tokens"] for r in members)
        weights = sum(r["weight"] for r in members)
        for r in members:
            r["share"] = round(r["_tokens"] / tokens, 3) if tokens else None
            r["fair_share"] = round(r["weight"] / weights, 3)
            del r["_tokens"]
