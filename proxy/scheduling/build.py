"""The one place that turns the config's ``policies:`` into a queue, a pool and a dispatcher,
and applies a reloaded config to them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from proxy.backends.adapter_rules import policy_for
from proxy.backends.pool import BackendPool
from proxy.config.adapters import adapters_of_tiers, model_visible
from proxy.config.schema import Config
from proxy.config.tenants import allowed_models
from proxy.policies import registry
from proxy.policies.backends import BackendChooser
from proxy.policies.displacement import LargestShare
from proxy.policies.order import ShortFirst
from proxy.policies.tenants import VirtualTokenCounter
from proxy.policies.tiers import StrideTierSelector
from proxy.policies.types import TierLimits
from proxy.scheduling.dispatch import Dispatcher
from proxy.scheduling.queue import AdmissionQueue, QueuePolicies
from proxy.telemetry.metrics import ProxyMetrics
from proxy.telemetry.slo import slo_miss_budget

log = logging.getLogger("tierproxy.policies")

_QUEUE_SEAMS = ("tiers", "tenants", "order", "displacement")


def tier_limits(config: Config) -> dict[str, TierLimits]:
    return {
        name: TierLimits(t.weight, t.max_queue, t.queue_timeout_s, t.priority, t.early_refusal)
        for name, t in config.tiers.items()
    }


def queue_policies(config: Config) -> QueuePolicies:
    chosen = config.policies
    return QueuePolicies(
        tiers=registry.TIERS[chosen.tiers](config),
        tenants=registry.TENANTS[chosen.tenants](config),
        order=registry.ORDERS[chosen.order](config),
        displacement=registry.DISPLACEMENTS[chosen.displacement](config),
    )


def backend_chooser(config: Config, clock: Callable[[], float] = time.monotonic) -> BackendChooser:
    name = config.policies.backends
    clocked = registry.CLOCKED_BACKENDS.get(name)
    return clocked(config, clock) if clocked is not None else registry.BACKENDS[name](config)


@dataclass
class Scheduling:
    """The queue, the pool and the dispatcher built from one config."""

    queue: AdmissionQueue
    pool: BackendPool
    dispatcher: Dispatcher
    config: Config

    def reconfigure(self, config: Config, tenant_names: frozenset[str] | None = None) -> None:
        """Apply a reloaded config in place. A change of queue policies rebuilds the queue's
        order keeping every queued request and its deadline (the new policies start with no
        fairness history); a change of backend policy starts it with no memory.
        ``tenant_names``: the config's tenant names where already known (made off the loop)."""
        old, new = self.config.policies, config.policies
        changed = [s for s in _QUEUE_SEAMS if getattr(old, s) != getattr(new, s)]
        if changed:
            log.warning(
                "policies changed (%s): re-queueing %d requests under the new policies",
                ", ".join(f"{s}: {getattr(old, s)} -> {getattr(new, s)}" for s in changed),
                len(self.queue),
            )
            self.queue.replace_policies(queue_policies(config))
        order = None
        if not changed and config.scheduling != self.config.scheduling:
            order = registry.ORDERS[new.order](config)  # new parameters, for new arrivals
        self.queue.reconfigure(tier_limits(config), order=order)
        names = tenant_names if tenant_names is not None else {t.name for t in config.tenants}
        self.queue.fairness.forget(names)
        if chooser_inputs(self.config) != chooser_inputs(config):
            log.warning(
                "backend policy or its parameters changed (%s -> %s): the chooser starts over",
                old.backends,
                new.backends,
            )
            self.pool.chooser = backend_chooser(config, self.dispatcher.clock)
        registry.retune(self.pool.chooser, config)  # what it kept reads the new tenants file
        adapters = set(self.pool.adapters)  # the catalogue the queued requests came under
        set_best_tier_reserve(self.pool, config)
        self.pool.reconfigure(
            config.backends,
            config.backend_health,
            config.adaptive_room,
            miss_budget=slo_miss_budget(config),
        )
        adapters |= set(self.pool.adapters)
        refused = self.dispatcher.refuse_unservable(
            lambda r: (
                r.model not in adapters
                or (self.pool.serves_adapter(r.model) and self._may_use(config, r.tenant, r.model))
            )
        )
        if refused:
            log.warning(
                "%d queued adapter requests answered 404: no backend serves them, or their"
                " tenant may no longer use them",
                refused,
            )
        self.config = config

    def _may_use(self, config: Config, tenant_name: str, model: str) -> bool:
        """Whether the tenant may still use ``model`` under the reloaded ``config`` (the check
        a new request meets, proxy.request.tenancy: red team F3 of round g, a queued request
        was served and billed 12.8 s after a reload revoked its tenant's access)."""
        tenant = next((t for t in config.tenants if t.name == tenant_name), None)
        if tenant is None or tenant.tier not in config.tiers:
            return False
        patterns = allowed_models(tenant, config.tiers[tenant.tier])
        strays = self.pool.engine_adapters()
        return model_visible(model, patterns, config.adapters, tenant, strays)


def chooser_inputs(config: Config) -> tuple[object, ...]:
    """What the backend chooser is built from (``registry.BACKENDS``): a reload that changes
    any of it builds a new one."""
    p = config.policies
    return (
        p.backends,
        p.prefix_affinity.memory,
        p.kv_aware,
        config.kv_cache.block_size,
        tuple(sorted((name, t.priority) for name, t in config.tiers.items())),
    )


def build_scheduling(
    config: Config, metrics: ProxyMetrics, clock: Callable[[], float] = time.monotonic
) -> Scheduling:
    queue = AdmissionQueue(tier_limits(config), queue_policies(config))
    pool = BackendPool(
        config.backends,
        config.backend_health,
        backend_chooser(config, clock),
        config.adaptive_room,
        miss_budget=slo_miss_budget(config),
    )
    set_best_tier_reserve(pool, config)
    pool.token_reservations.is_next = queue.is_next
    return Scheduling(queue, pool, Dispatcher(queue, pool, metrics, clock), config)


def set_best_tier_reserve(pool: BackendPool, config: Config) -> None:
    """The tiers of the lowest ``priority`` among those with tenants take the reserve past a
    backend's room, and the reserve of adapter slots where one of their tenants may use an
    adapter; the catalogue. (A tier nobody is in never holds the reserve: it would keep it
    from every tenant — red team, a tenantless `premium` tier.)"""
    used = {t.tier for t in config.tenants}
    ranked = [t.priority for n, t in config.tiers.items() if n in used]
    best = min(ranked or [t.priority for t in config.tiers.values()], default=0)
    pool.best_tiers = frozenset(n for n, t in config.tiers.items() if t.priority == best)
    pool.best_tier_reserve = config.scheduling.best_tier_reserve
    pool.adapters = {name: a.base_model for name, a in config.adapters.items()}
    best_usable = adapters_of_tiers(config.adapters, config.tenants, pool.best_tiers)
    ranks = {name: t.priority for name, t in config.tiers.items()}
    knobs = config.scheduling.adapter_slots
    pool.adapter_policy = policy_for(knobs, pool.adapters, best_usable, ranks)
    pool.token_reservations.ranks = ranks


def default_queue_policies(
    *, aging_s: float = 30.0, reference_tokens: float = 8192
) -> QueuePolicies:
    """The default policies (stride, vtc, short_first, largest_share) for a queue built by
    hand, as in tests and benchmarks."""
    return QueuePolicies(
        tiers=StrideTierSelector(),
        tenants=VirtualTokenCounter(),
        order=ShortFirst(reference_tokens=reference_tokens, aging_s=aging_s),
        displacement=LargestShare(),
    )
