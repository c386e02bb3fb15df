"""Named implementations of each seam, as the ``policies:`` section of the config names them.

A new policy is one class in its seam's module plus one line here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from proxy.config.tenants import cache_groups
from proxy.policies.backends import BackendChooser, LeastUtilised, PrefixAffinity
from proxy.policies.displacement import Displacement, LargestShare, NoDisplacement
from proxy.policies.kvaware import KvAware
from proxy.policies.kvterms import latency_weights
from proxy.policies.order import Fcfs, RequestOrder, ShortFirst
from proxy.policies.tenants import EarliestDeadlineFirst, TenantFairness, VirtualTokenCounter
from proxy.policies.tiers import StrictPriorityTierSelector, StrideTierSelector, TierSelector

if TYPE_CHECKING:
    from proxy.config.schema import Config

T = TypeVar("T")
Registry = Mapping[str, Callable[["Config"], T]]

TIERS: Registry[TierSelector] = {
    "stride": lambda cfg: StrideTierSelector(),
    "strict_priority": lambda cfg: StrictPriorityTierSelector(),
}
TENANTS: Registry[TenantFairness] = {
    "vtc": lambda cfg: VirtualTokenCounter(),
    "edf": lambda cfg: EarliestDeadlineFirst(),
}
ORDERS: Registry[RequestOrder] = {
    "short_first": lambda cfg: ShortFirst(
        reference_tokens=cfg.scheduling.reference_tokens, aging_s=cfg.scheduling.aging_s
    ),
    "fcfs": lambda cfg: Fcfs(),
}
DISPLACEMENTS: Registry[Displacement] = {
    "largest_share": lambda cfg: LargestShare(),
    "none": lambda cfg: NoDisplacement(),
}
BACKENDS: Registry[BackendChooser] = {
    "least_utilised": lambda cfg: LeastUtilised(),
    "prefix_affinity": lambda cfg: PrefixAffinity(cfg.policies.prefix_affinity.memory),
    "kv_aware": lambda cfg: kv_aware(cfg),
}


def kv_aware(cfg: Config, clock: Callable[[], float] = time.monotonic) -> KvAware:
    knobs = cfg.policies.kv_aware
    return KvAware(
        block_size=cfg.kv_cache.block_size,
        latency_weights=latency_weights(
            {name: t.priority for name, t in cfg.tiers.items()},
            knobs.room_weight_best,
            knobs.room_weight_worst,
        ),
        hold_s=knobs.hold_s,
        work_weight=knobs.work_weight,
        pending_blocks=knobs.memory_blocks,
        cache_groups=cache_groups(cfg.tenants, cfg.tiers),
        clock=clock,
    )


def retune(chooser: BackendChooser, cfg: Config) -> None:
    """What a chooser kept across a reload reads of the new config: ``kv_aware``, the tenants
    file's cache groups (its apart rule)."""
    if isinstance(chooser, KvAware):
        chooser.cache_groups = cache_groups(cfg.tenants, cfg.tiers)


# The choosers that keep time of their own, built on the scheduling's clock (a simulation's).
CLOCKED_BACKENDS: Mapping[str, Callable[[Config, Callable[[], float]], BackendChooser]] = {
    "kv_aware": kv_aware,
}


# The config field of each seam -> its valid names.
CHOICES: Mapping[str, Mapping[str, object]] = {
    "tiers": TIERS,
    "tenants": TENANTS,
    "order": ORDERS,
    "displacement": DISPLACEMENTS,
    "backends": BACKENDS,
}
