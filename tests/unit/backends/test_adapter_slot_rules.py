"""Who may open an engine's adapter slot (proxy.backends.adapter_rules) on plain objects and
an injected time: the best tier's reserve (worse tiers never run the engine's last free
distinct adapter slots), a tenant's share while another tenant wants a slot (distinct adapters
in flight, and which idle adapter it gives up), and both giving way where nobody would use
what they hold back."""

from __future__ import annotations

from typing import Any

from proxy.backends.adapter_rules import AdapterPolicy, SlotRules, begin, fit
from proxy.backends.adapter_slots import AdapterSlots, LoadPlan, SlotUser
from proxy.config.backends import Backend
from proxy.config.scheduling import AdapterSlotKnobs
from proxy.config.schema import Config
from proxy.scheduling.build import build_scheduling
from proxy.telemetry.metrics import ProxyMetrics

HIGH = SlotUser("tenant-high", best=True)
LOW = SlotUser("tenant-low", best=False)
CYCLER = SlotUser("cycler", best=False)
OTHER = SlotUser("other", best=False)
# Two slots, the defaults: one kept for the best tier, a tenant's share one slot.
RULES = SlotRules(max_loras=2, reserve=1, tenant_cap=1, claim_s=300.0)


def _run(slots: AdapterSlots, adapter: str, user: SlotUser, now: float) -> LoadPlan | None:
    """A request that fits starts (its load, if any, succeeds at once)."""
    assert fit(slots, adapter, user, RULES, now) is not None, (adapter, user)
    plan = begin(slots, adapter, user, RULES, now)
    if plan is not None:
        if plan.unload is not None:
            slots.unload_done(plan.unload)
        slots.load_done(plan.load, ok=True)
    return plan


def test_worse_tiers_leave_the_reserve_to_the_best_tier() -> None:
    slots = AdapterSlots()
    _run(slots, "low-1", LOW, 0.0)  # a long generation
    # Its second adapter would take the last slot: it waits; more of the first one do not.
    assert fit(slots, "low-2", LOW, RULES, 1.0) is None
    assert fit(slots, "low-1", LOW, RULES, 1.0) == "has"
    assert fit(slots, "high-1", HIGH, RULES, 1.0) == "load"  # the reserve
    _run(slots, "high-1", HIGH, 1.0)
    assert slots.running() == {"low-1", "high-1"}
    slots.end("low-1", LOW, 2.0)
    assert fit(slots, "low-2", LOW, RULES, 2.0) == "load"  # worse tiers run nothing now


def test_joining_an_adapter_only_the_best_tier_runs_counts_against_the_worse_tiers() -> None:
    slots = AdapterSlots()
    _run(slots, "shared", HIGH, 0.0)
    _run(slots, "shared", LOW, 0.0)  # no new slot, but its generation keeps this one busy
    assert fit(slots, "other-2", OTHER, RULES, 0.0) is None
    assert fit(slots, "high-2", SlotUser("another-high"), RULES, 0.0) == "load"


def test_a_tenant_past_its_share_waits_while_another_tenant_wants_a_slot() -> None:
    slots = AdapterSlots()
    rules = SlotRules(max_loras=3, tenant_cap=1, claim_s=300.0)  # no reserve: one tier
    _run(slots, "theirs", OTHER, 0.0)
    slots.end("theirs", OTHER, 1.0)  # idle, but used a moment ago: wanted
    _run(slots, "a", CYCLER, 2.0)  # its long generation
    # A second distinct adapter, though a slot is free: that one is left for the others.
    assert fit(slots, "b", CYCLER, rules, 3.0) is None
    assert fit(slots, "a", CYCLER, rules, 3.0) == "has"
    # Once nobody else wanted a slot for claim_s, it may use them all.
    assert fit(slots, "b", CYCLER, rules, 1.0 + 300.5) == "load"


def test_another_tenant_running_a_shared_adapter_wants_a_slot_too() -> None:
    slots = AdapterSlots()
    rules = SlotRules(max_loras=3, tenant_cap=1)
    _run(slots, "shared", OTHER, 0.0)
    _run(slots, "shared", CYCLER, 1.0)  # used last by the cycler: both claim it still
    assert fit(slots, "b", CYCLER, rules, 2.0) is None
    slots.end("shared", OTHER, 3.0)
    assert fit(slots, "b", CYCLER, rules, 4.0) is None  # the other's claim: used at 3.0
    assert fit(slots, "b", CYCLER, rules, 3.0 + rules.claim_s + 1) == "load"  # alone now


def test_a_tenant_alone_uses_every_slot() -> None:
    slots = AdapterSlots()
    rules = SlotRules(max_loras=3, reserve=0, tenant_cap=1)
    for name in ("a", "b", "c"):
        assert fit(slots, name, CYCLER, rules, 0.0) == "load"
        begin(slots, name, CYCLER, rules, 0.0)
    assert slots.running() == {"a", "b", "c"}


def test_cycling_adapters_churns_only_the_tenants_own_slot() -> None:
    """The red team's churn: a tenant cycling three adapters with short requests made another
    tenant's adapter load again on 9 of its 10 requests."""
    slots = AdapterSlots()
    theirs_loads = 0
    now = 0.0
    for _ in range(10):
        for name in ("s1", "s2", "s3"):
            _run(slots, name, CYCLER, now)
            slots.end(name, CYCLER, now + 0.1)
            now += 1.0
        plan = _run(slots, "theirs", OTHER, now)
        theirs_loads += plan is not None
        slots.end("theirs", OTHER, now + 0.1)
        now += 1.0
    assert theirs_loads == 1  # loaded once, never given up for the cycler's adapters
    assert "theirs" in slots.held


def test_an_adapter_nobody_wanted_for_claim_s_is_anyones_to_give_up() -> None:
    slots = AdapterSlots()
    _run(slots, "theirs", OTHER, 0.0)
    slots.end("theirs", OTHER, 0.0)
    _run(slots, "s1", CYCLER, 1.0)
    slots.end("s1", CYCLER, 1.0)
    assert begin(slots, "s2", CYCLER, RULES, 2.0) == LoadPlan("s2", unload="s1")
    slots.end("s2", CYCLER, 2.0)
    slots.load_done("s2", ok=True)
    slots.unload_done("s1")
    # `theirs` unused for longer than claim_s: the least recently used goes, whoever's it was.
    assert begin(slots, "s3", CYCLER, RULES, 400.0) == LoadPlan("s3", unload="theirs")


def test_the_policy_keeps_a_reserve_only_where_it_can_serve_the_best_tier() -> None:
    two = Backend(url="http://x:1", max_loras=2, load_adapters=True)
    one = Backend(url="http://y:1", max_loras=1)
    policy = AdapterPolicy(AdapterSlotKnobs(), reserve_bases=frozenset({"tiny"}))
    assert policy.rules(two, "tiny") == SlotRules(2, True, 1, 1, 5.0)
    assert policy.rules(two, "other-base") == SlotRules(2, True, 0, 1, 5.0)
    assert policy.rules(one, "tiny") == SlotRules(1, False, 0, 1, 5.0)  # never its last slot
    whole = AdapterPolicy(AdapterSlotKnobs(best_tier_reserve=0, tenant_share=1.0))
    assert whole.rules(two, "tiny") == SlotRules(2, True, 0, None, 5.0)
    assert policy.rules(Backend(url="http://z:1"), "tiny") is None  # no LoRA there
    big = Backend(url="http://w:1", max_loras=8)
    assert policy.rules(big, "tiny") == SlotRules(8, False, 1, 4, 5.0)


def _config(adapters: dict[str, Any]) -> Config:
    tier = {"weight": 1, "max_queue": 1, "queue_timeout_s": 1, "request_timeout_s": 1}
    return Config.model_validate(
        {
            "tiers": {"high": {**tier, "priority": 0}, "low": {**tier, "priority": 10}},
            "tenants": [
                {"name": "h", "tier": "high", "keys": [{"sha256": "0" * 64}]},
                {"name": "l", "tier": "low", "keys": [{"sha256": "1" * 64}]},
            ],
            "backends": [{"url": "http://x:1", "max_loras": 2}],
            "adapters": adapters,
        }
    )


def test_the_reserve_is_kept_only_for_a_base_model_a_best_tier_tenant_may_use() -> None:
    lows = {"lows": {"path": "/l", "base_model": "tiny", "tenants": ["l"]}}
    pool = build_scheduling(_config(lows), ProxyMetrics()).pool
    assert pool.adapter_policy.reserve_bases == frozenset()  # nobody of the best tier to serve
    shared = {**lows, "both": {"path": "/b", "base_model": "tiny", "shared": True}}
    pool = build_scheduling(_config(shared), ProxyMetrics()).pool
    assert pool.adapter_policy.reserve_bases == frozenset({"tiny"})


def test_a_join_waits_behind_another_tenants_request_for_a_slot() -> None:
    slots = AdapterSlots()
    _run(slots, "low-1", LOW, 0.0)
    slots.waiting.add((OTHER.tenant, False))  # found no slot anywhere this dispatch pass
    assert fit(slots, "low-1", LOW, RULES, 1.0) is None  # would hold the slot past it
    assert fit(slots, "low-1", OTHER, RULES, 1.0) == "has"  # its own tenant: no
    _run(slots, "high-1", HIGH, 1.0)
    # A worse tenant waits: best-tier joins wait too (else they starve the worse tiers).
    assert fit(slots, "high-1", SlotUser("another-high"), RULES, 1.0) is None
    slots.waiting.clear()
    assert fit(slots, "high-1", SlotUser("another-high"), RULES, 1.0) == "has"
    slots.waiting.add(("another-high", True))
    assert fit(slots, "high-1", HIGH, RULES, 1.0) is None  # behind the best tier's request
