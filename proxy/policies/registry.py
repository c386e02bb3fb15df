"""Named implementations of each seam, as the ``policies:`` section of the config names them.

A new policy is one class in its seam's module plus one line here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from proxy.policies.backends import BackendChooser, LeastUtilised, PrefixAffinity
from proxy.policies.displacement import Displacement, LargestShare, NoDisplacement
from proxy.policies.kvaware import KvAware, latency_weights
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
    "kv_aware": lambda cfg: KvAware(
        block_size=cfg.kv_cache.block_size,
        latency_weights=latency_weights(
            {name: t.priority for name, t in cfg.tiers.items()},
            cfg.policies.kv_aware.room_weight_best,
            cfg.policies.kv_aware.room_weight_worst,
        ),
        hold_s=cfg.policies.kv_aware.hold_s,
    ),
}


# The config field of each seam -> its valid names.
CHOICES: Mapping[str, Mapping[str, object]] = {
    "tiers": TIERS,
    "tenants": TENANTS,
    "order": ORDERS,
    "displacement": DISPLACEMENTS,
    "backends": BACKENDS,
}
