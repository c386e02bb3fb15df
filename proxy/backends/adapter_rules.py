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
  tenant's requests run at most ``cap`` distinct adapters there. Alone on an engine a tenant
  may use every slot (nothing is held back for nobody).
- **Which idle adapter goes.** Never one another tenant of a better tier claims: a worse
  tier's request waits for a slot or for that claim to lapse. Then one nobody claims, the
  requester's own, one only worse tiers claim (a worse tier's idle adapter never keeps a
  better tier waiting), and last a peer's of its own tier, only while the requester is below
  its share: cycling through many adapters churns only its own slots.
- **Wanted adapters stay.** An idle adapter that the queue's next request of some tenant
  wants is given up last. A request that could only give up such an adapter, of a waiting
  request of its tier or a better one, waits for it instead, at most ``locality_wait_s`` from
  its arrival: the other request then runs on the held adapter, rather than one load now and
  a reload for the other (adapters thrashing through the slots in the queue's order).
- **Due.** A request that has waited ``due_share`` of its tier's queue timeout is due: on the
  engines where it waits for a slot, nobody joins a running adapter or starts an idle one
  ahead of it, and it may give up any idle adapter, one a better tier claims included. Without
  it, better tiers that keep every slot of an engine busy would hold a worse tier's adapter
  requests to their queue timeout, whatever the tiers' weights.
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

    def user(
        self,
        tenant: str,
        tier: str,
        best: bool,
        wait: tuple[float, float, float] | None = None,
    ) -> SlotUser:
        """Who a request of ``tenant`` in ``tier`` is for the slot rules; ``wait``: when it
        was queued, its queue deadline, and now."""
        if wait is None:
            return SlotUser(tenant, best, self.ranks.get(tier, 0))
        arrived, deadline, now = wait
        patient = arrived + self.knobs.locality_wait_s
        due = self.due(arrived, deadline, now)
        return SlotUser(tenant, best, self.ranks.get(tier, 0), patient, due)

    def due(self, arrived: float, deadline: float, now: float) -> bool:
        """A request queued at ``arrived`` with that queue deadline is due now."""
        return now >= arrived + self.knobs.due_share * (deadline - arrived)

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
    """The idle adapter a load for ``user`` gives up; None: none it may. Never one another
    tenant of a better tier claims (a worse tier's request waits for a slot or for that claim
    to lapse: red team F1, one low request every 5 s made two best-tier tenants reload in
    turn). Of the rest: one nobody claims, then one only ``user``'s tenant claims, then one
    only worse tiers claim (their idle claims never keep it waiting), then one a peer of its
    tier claims, unless it claims its share here already while others claim adapters here
    too; the least recently used first, and one another replica claims (it may be running
    it) only when there is no other. A tenant's claim is its own: touching another tenant's
    shared adapter makes it no less theirs (red team F5 of the last round)."""
    claims = slots.claims(now, rules.claim_s)
    over = False
    if rules.tenant_cap is not None:
        mine = sum(1 for by in claims.values() if user.tenant in by)
        over = mine >= rules.tenant_cap
    ranked = []
    for at, name in slots.idle():
        order = _order(claims.get(name, {}), user, over)
        if order is None and user.due:
            order = 4  # a due request gives up any idle adapter, a better tier's last
        if order is not None:
            wanted = slots.demand(name) is not None
            ranked.append((name in slots.elsewhere, wanted, order, at, name))
    return min(ranked)[4] if ranked else None


def defers(slots: AdapterSlots, user: SlotUser, rules: SlotRules, now: float) -> bool:
    """A load for ``user`` here would give up an idle adapter that the queue's next request
    of a tenant of its tier or a better one wants, and ``user``'s request is still within its
    patience: it waits, so that the other runs on the adapter held (rules: "Wanted adapters
    stay")."""
    if now >= user.patient_until:
        return False
    gives_up = victim(slots, user, rules, now)
    if gives_up is None:
        return False
    rank = slots.demand(gives_up)
    return rank is not None and rank <= user.rank


def _order(claimants: Mapping[str, int], user: SlotUser, over: bool) -> int | None:
    """How readily ``user`` gives up an idle adapter so claimed (lower first); None: never."""
    others = [rank for t, rank in claimants.items() if t != user.tenant]
    if any(rank < user.rank for rank in others):
        return None  # a better tier's
    if not claimants:
        return 0
    if not others:
        return 1  # its own
    if all(rank > user.rank for rank in others):
        return 2  # only worse tiers'
    return None if over else 3  # a peer's: only while it is below its share


def protected(slots: AdapterSlots, user: SlotUser, rules: SlotRules, now: float) -> bool:
    """Every slot here is taken by an adapter another tenant of a better tier claims (running
    or idle): ``user``'s request cannot get one until such a claim lapses, so it does not
    wait here for generations to end (and holds back no join)."""
    if user.due:
        return False  # it gives up a better tier's idle adapter once one is idle
    claims = slots.claims(now, rules.claim_s)
    taken = sum(
        1
        for name in slots.held
        if any(t != user.tenant and r < user.rank for t, r in claims.get(name, {}).items())
    )
    return taken >= rules.max_loras


def fit(
    slots: AdapterSlots,
    adapter: str,
    user: SlotUser,
    rules: SlotRules,
    now: float,
    *,
    patient: bool = True,
) -> Fit | None:
    """Whether ``user``'s request for ``adapter`` may start here now: "has" (held, or being
    loaded), "load" (a slot is free or an idle one can be given up), None (it waits).
    ``patient`` False: as if its patience had ended (``defers``)."""
    running = slots.running()
    if adapter in running and _behind(slots, user):
        return None
    if adapter in slots.held and adapter not in running and _due_behind(slots, user):
        return None  # an idle adapter is the slot a due request waits for
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
    if len(slots.held) < rules.max_loras:
        return "load"
    if victim(slots, user, rules, now) is not None and not (
        patient and defers(slots, user, rules, now)
    ):
        return "load"
    return None


def _behind(slots: AdapterSlots, user: SlotUser) -> bool:
    """Another tenant's request waits here for a slot, of any tier: were best-tier requests let
    join while a worse one waits, two best-tier tenants keeping their adapters busy would
    starve every worse tier's adapters (red team: a low request's 503 after its 60 s)."""
    return any(t != user.tenant for t, _best in slots.waiting)


def _due_behind(slots: AdapterSlots, user: SlotUser) -> bool:
    """Another tenant's due request waits here for a slot."""
    return any(t != user.tenant for t in slots.due_waiting)


def waits_for_slot(
    slots: AdapterSlots, adapter: str, user: SlotUser, rules: SlotRules, now: float
) -> bool:
    """``fit`` refused the request here for a slot another tenant's requests hold: not for its
    own tenant's share, nor because the adapter cannot be loaded here, nor because better
    tiers claim every slot (it waits for a claim to lapse, not for a generation to end)."""
    if adapter in slots.running() or not (rules.may_load or adapter in slots.held):
        return False
    if protected(slots, user, rules, now):
        return False
    cap = tenant_cap(slots, user, rules, now)
    return cap is None or len(slots.running_of(user.tenant)) < cap


def begin(
    slots: AdapterSlots, adapter: str, user: SlotUser, rules: SlotRules, now: float
) -> LoadPlan | None:
    """Count the request in (``fit`` said it may start); the load plan it must carry out."""
    full = adapter not in slots.held and len(slots.held) >= rules.max_loras
    unload = victim(slots, user, rules, now) if full else None
    if full and unload is None and (idle := slots.idle()):
        # ``fit`` saw one it may give up; should a caller's view differ, the engine still
        # never holds more than max_loras (the least recently used idle one goes).
        unload = min(idle)[1]
    claimants = slots.claims(now, rules.claim_s).get(unload, {}) if unload is not None else {}
    others = any(t != user.tenant for t in claimants)
    return slots.begin(adapter, user, unload, now, others)


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
