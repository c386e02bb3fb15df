"""Who may open one of an engine's LoRA adapter slots, and which idle adapter a request gives
up for its own (``scheduling.adapter_slots``, docs/adapters.md). Pure logic on a backend's
``AdapterSlots``; the time is passed in.

vLLM cannot preempt an adapter: a slot given to a long generation stays taken until it ends,
and tiers that order the proxy's queue cannot take it back. So slots are held back before the
request that needs them comes:

- **The best tier's reserve.** Worse tiers' requests run at most ``max_loras - reserve``
  distinct adapters on an engine; a best-tier request may open any slot. A worse-tier request
  for an adapter worse tiers already run there takes no new slot and is let in; one that joins
  an adapter only the best tier runs is counted (else worse tiers could keep a best-tier slot
  busy past its own requests).
- **A tenant's share.** Each tenant that used a held adapter claims it (running, or used
  within ``claim_s``), each on its own. While another tenant wants a slot on the engine (runs
  a request there, or claims an adapter there and is of a tier as good or better), one
  tenant's requests run at most ``cap`` distinct adapters there, and a tenant that claims
  ``cap`` adapters there already makes room by giving up one of its own idle adapters (or one
  nobody claims), else one only worse tiers claim, never one its tier or a better one claims:
  cycling through many adapters then churns only its own slots, and a worse tier's idle
  adapter never keeps a better tier waiting. Alone on an engine a tenant may use every slot
  (nothing is held back for nobody).
- **No queue-jumping by joining.** While a request of another tenant waits for a slot on the
  engine (it found none anywhere in this dispatch pass), a request does not join an adapter
  that already runs there, whatever the tiers: else a tenant whose requests overlap on one
  adapter would hold its slot for ever, and the waiting one would wait past its queue
  timeout, not for one generation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from proxy.backends.adapter_slots import AdapterSlots, Fit, LoadPlan, SlotUser
from proxy.config.backends import Backend
from proxy.config.scheduling import AdapterSlotKnobs


@dataclass(frozen=True)
class SlotRules:
    """One engine's slot rules for one adapter's requests."""

    max_loras: int
    may_load: bool = True
    reserve: int = 0  # slots worse tiers never open (already below max_loras)
    tenant_cap: int | None = None  # distinct adapters of one tenant; None: no bound
    claim_s: float = 5.0


@dataclass
class AdapterPolicy:
    """The knobs, and the base models some best-tier tenant may use an adapter of (only there
    is a reserve kept: elsewhere no best-tier request could ever use it)."""

    knobs: AdapterSlotKnobs = field(default_factory=AdapterSlotKnobs)
    reserve_bases: frozenset[str] = frozenset()
    ranks: Mapping[str, int] = field(default_factory=dict)  # tier -> its priority

    def user(self, tenant: str, tier: str, best: bool) -> SlotUser:
        """Who a request of ``tenant`` in ``tier`` is for the slot rules."""
        return SlotUser(tenant, best, self.ranks.get(tier, 0))

    def rules(self, cfg: Backend, base: str) -> SlotRules | None:
        """The rules on backend ``cfg`` for an adapter of ``base``; None: it runs no adapter."""
        if cfg.max_loras is None:
            return None
        m = cfg.max_loras
        reserve = min(self.knobs.best_tier_reserve, m - 1) if base in self.reserve_bases else 0
        share = self.knobs.tenant_share
        cap = None if share >= 1 else max(1, math.floor(share * m))
        return SlotRules(m, cfg.load_adapters, reserve, cap, self.knobs.claim_s)


def _others_want(slots: AdapterSlots, user: SlotUser, rules: SlotRules, now: float) -> bool:
    """Another tenant wants a slot here: it runs a request here, or claims an idle adapter
    and is of a tier as good as ``user``'s or better (a worse tier's idle claim never keeps a
    better tier's request waiting: red team F2)."""
    if any(t != user.tenant for t in slots.by_tenant):
        return True
    return any(
        t != user.tenant and rank <= user.rank
        for by in slots.claims(now, rules.claim_s).values()
        for t, rank in by.items()
    )


def tenant_cap(slots: AdapterSlots, user: SlotUser, rules: SlotRules, now: float) -> int | None:
    """The most distinct adapters ``user``'s tenant may use on this engine now (None: no
    bound)."""
    if rules.tenant_cap is None or not _others_want(slots, user, rules, now):
        return None
    return rules.tenant_cap


def victim(slots: AdapterSlots, user: SlotUser, rules: SlotRules, now: float) -> str | None:
    """The idle adapter a load for ``user`` gives up: the least recently used one (of those
    no other replica claims, if any). A tenant that claims its share here already, while other
    tenants claim adapters here too, gives up one of its own or one nobody claims; failing
    that, one only worse tiers claim (their idle claims never keep it waiting); never one a
    tenant of its tier or a better one claims. A tenant's claim is its own: touching another
    tenant's shared adapter makes it no less theirs (red team F5)."""
    idle = slots.idle()
    if rules.tenant_cap is not None:
        claims = slots.claims(now, rules.claim_s)
        others = {n: by for n, by in claims.items() if any(t != user.tenant for t in by)}
        mine = sum(1 for by in claims.values() if user.tenant in by)
        if others and mine >= rules.tenant_cap:
            free = [(t, n) for t, n in idle if n not in others]
            idle = free or [(t, n) for t, n in idle if not _binding(others[n], user)]
    # One another replica claims (it may be running it) only when there is no other.
    return min(idle, key=lambda tn: (tn[1] in slots.elsewhere, tn))[1] if idle else None


def _binding(claimants: Mapping[str, int], user: SlotUser) -> bool:
    """Some other tenant of ``user``'s tier or a better one claims the adapter."""
    return any(t != user.tenant and rank <= user.rank for t, rank in claimants.items())


def fit(
    slots: AdapterSlots, adapter: str, user: SlotUser, rules: SlotRules, now: float
) -> Fit | None:
    """Whether ``user``'s request for ``adapter`` may start here now: "has" (held, or being
    loaded), "load" (a slot is free or an idle one can be given up), None (it waits)."""
    running = slots.running()
    if adapter in running and _behind(slots, user):
        return None
    if adapter not in running and len(running) >= rules.max_loras:
        return None
    worse = slots.worse_running()
    if not user.best and adapter not in worse and len(worse) >= rules.max_loras - rules.reserve:
        return None  # the best tier's reserve
    mine = slots.running_of(user.tenant)
    cap = tenant_cap(slots, user, rules, now)
    if cap is not None and adapter not in mine and len(mine) >= cap:
        return None  # the tenant's share
    if adapter in slots.held:
        return "has"
    if not rules.may_load:
        return None
    if len(slots.held) < rules.max_loras or victim(slots, user, rules, now) is not None:
        return "load"
    return None


def _behind(slots: AdapterSlots, user: SlotUser) -> bool:
    """Another tenant's request waits here for a slot, of any tier: were best-tier requests let
    join while a worse one waits, two best-tier tenants keeping their adapters busy would
    starve every worse tier's adapters (red team: a low request's 503 after its 60 s)."""
    return any(t != user.tenant for t, _best in slots.waiting)


def waits_for_slot(
    slots: AdapterSlots, adapter: str, user: SlotUser, rules: SlotRules, now: float
) -> bool:
    """``fit`` refused the request here for a slot another tenant's requests hold: not for its
    own tenant's share, nor because the adapter cannot be loaded here."""
    if adapter in slots.running() or not (rules.may_load or adapter in slots.held):
        return False
    cap = tenant_cap(slots, user, rules, now)
    return cap is None or len(slots.running_of(user.tenant)) < cap


def begin(
    slots: AdapterSlots, adapter: str, user: SlotUser, rules: SlotRules, now: float
) -> LoadPlan | None:
    """Count the request in (``fit`` said it may start); the load plan it must carry out."""
    full = adapter not in slots.held and len(slots.held) >= rules.max_loras
    unload = victim(slots, user, rules, now) if full else None
    return slots.begin(adapter, user, unload, now)


def policy_for(
    knobs: AdapterSlotKnobs,
    bases: Mapping[str, str],
    best_usable: frozenset[str],
    ranks: Mapping[str, int],
) -> AdapterPolicy:
    """The policy from the knobs, the catalogue (adapter -> base), the adapters some best-tier
    tenant may use and each tier's rank (its priority)."""
    reserve_bases = frozenset(bases[n] for n in best_usable if n in bases)
    return AdapterPolicy(knobs, reserve_bases, dict(ranks))
