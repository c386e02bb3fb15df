"""Which idle adapter a load gives up (proxy.backends.adapter_rules.victim), on plain objects and
an injected time: never one a better tier's tenant claims (red team F1 of round g: one low-tier
1-token request every 5 s made two best-tier tenants' adapters reload in turn), and within a
tier one nobody claims, then the requester's own, before a peer's."""

from __future__ import annotations

from proxy.backends.adapter_rules import SlotRules, begin, fit, waits_for_slot
from proxy.backends.adapter_slots import AdapterSlots, LoadPlan, SlotUser

HI1 = SlotUser("hi1", best=True, rank=0)
HI2 = SlotUser("hi2", best=True, rank=0)
LO1 = SlotUser("lo1", best=False, rank=10)
# The example configuration's knobs on a two-slot engine.
RULES = SlotRules(max_loras=2, reserve=1, tenant_cap=1, claim_s=5.0)


def _run(slots: AdapterSlots, adapter: str, user: SlotUser, now: float, rules: SlotRules) -> bool:
    """One 1-token request, if it fits: begun, its load done, ended. True if it loaded."""
    if fit(slots, adapter, user, rules, now) is None:
        return False
    plan = begin(slots, adapter, user, rules, now)
    if plan is not None:
        if plan.unload is not None:
            slots.unload_done(plan.unload)
        slots.load_done(plan.load, ok=True)
    slots.end(adapter, user, now + 0.05)
    return plan is not None


def test_a_low_request_every_5_s_reloads_no_best_tier_adapter() -> None:
    slots = AdapterSlots()
    loads = {"ad-a": 0, "ad-b": 0}
    low_waited = 0
    for tick in range(60):
        now = float(tick)
        loads["ad-a"] += _run(slots, "ad-a", HI1, now, RULES)
        loads["ad-b"] += _run(slots, "ad-b", HI2, now + 0.5, RULES)
        if tick % 5 == 2:
            low_waited += fit(slots, "ad-d", LO1, RULES, now + 0.7) is None
            _run(slots, "ad-d", LO1, now + 0.7, RULES)
    assert loads == {"ad-a": 1, "ad-b": 1}  # on main: 13 and 13 (reloaded in turn)
    assert low_waited == 12  # it waits: both slots are claimed by the better tier
    # Once the best tier's claims lapse, the low request gets a slot.
    assert fit(slots, "ad-d", LO1, RULES, 59.6 + RULES.claim_s + 0.1) == "load"


def test_a_worse_request_blocked_only_by_better_claims_holds_back_no_join() -> None:
    slots = AdapterSlots()
    begin(slots, "ad-a", HI1, RULES, 0.0)  # long generations of the best tier
    begin(slots, "ad-b", HI2, RULES, 0.0)
    assert fit(slots, "ad-d", LO1, RULES, 1.0) is None
    # It cannot have either slot when they end (claimed): it does not wait for them here, so
    # it stops no best-tier request joining its own adapter.
    assert not waits_for_slot(slots, "ad-d", LO1, RULES, 1.0)
    assert waits_for_slot(slots, "ad-d", SlotUser("hi3", best=True, rank=0), RULES, 1.0)


def test_within_a_tier_one_nobody_claims_goes_first_even_if_newest() -> None:
    rules = SlotRules(max_loras=3, reserve=0, tenant_cap=2, claim_s=5.0)
    slots = AdapterSlots()
    _run(slots, "peer-1", HI2, 0.0, rules)  # the least recently used
    _run(slots, "own-1", HI1, 1.0, rules)
    slots.listed(frozenset({"peer-1", "own-1", "nobodys"}), 2.0)  # an engine's own, newest
    assert begin(slots, "x", HI1, rules, 2.5) == LoadPlan("x", unload="nobodys")


def test_below_its_share_a_tenant_gives_up_its_own_before_a_peers() -> None:
    rules = SlotRules(max_loras=3, reserve=0, tenant_cap=2, claim_s=5.0)
    slots = AdapterSlots()
    _run(slots, "peer-1", HI2, 0.0, rules)  # the least recently used
    _run(slots, "peer-2", HI2, 0.5, rules)
    _run(slots, "own-1", HI1, 1.0, rules)  # HI1 claims one: below its share of two
    assert begin(slots, "own-2", HI1, rules, 2.0) == LoadPlan("own-2", unload="own-1")
