"""Adapter claims by tier and by tenant (proxy.backends.adapter_rules) on plain objects and an
injected time: a worse tier's idle adapter never keeps a better tier's request waiting (red team
F2: a best-tier tenant alternating two adapters was held to one slot by a low tenant's single
request), a peer tier's only for ``claim_s``; and a tenant touching another tenant's shared
adapter takes no claim away from it (red team F5: one 1-token request made it reload on every
cycle of the toucher's adapters)."""

from __future__ import annotations

from pathlib import Path

from proxy.backends.adapter_rules import SlotRules, begin, fit
from proxy.backends.adapter_slots import AdapterSlots, LoadPlan, SlotUser
from proxy.config.loader import load_config

HIGH = SlotUser("high", best=True, rank=0)
PEER = SlotUser("peer", best=True, rank=0)
NORMAL = SlotUser("normal", best=False, rank=5)
LOW = SlotUser("low", best=False, rank=10)
RULES = SlotRules(max_loras=2, reserve=1, tenant_cap=1, claim_s=300.0)


def _run(slots: AdapterSlots, adapter: str, user: SlotUser, now: float, rules: SlotRules) -> bool:
    """One short request that fits: begun, its load (if any) done, ended. True if it loaded."""
    assert fit(slots, adapter, user, rules, now) is not None, (adapter, user, now)
    plan = begin(slots, adapter, user, rules, now)
    if plan is not None:
        if plan.unload is not None:
            slots.unload_done(plan.unload)
        slots.load_done(plan.load, ok=True)
    slots.end(adapter, user, now + 0.1)
    return plan is not None


def test_a_worse_tiers_idle_adapter_never_keeps_the_best_tier_waiting() -> None:
    slots = AdapterSlots()
    _run(slots, "low-1", LOW, 0.0, RULES)  # one 2-token request: idle, claimed by `low`
    begin(slots, "a1", HIGH, RULES, 1.0)  # a long generation on its first adapter
    slots.load_done("a1", ok=True)
    # Its second adapter: not held to its share by the idle claim; `low-1` is given up.
    assert fit(slots, "a2", HIGH, RULES, 2.0) == "load"
    assert begin(slots, "a2", HIGH, RULES, 2.0) == LoadPlan("a2", unload="low-1")
    slots.load_done("a2", ok=True)
    slots.end("a1", HIGH, 3.0)
    slots.end("a2", HIGH, 3.0)
    # Alternating from then on: both held, nothing loads again.
    assert not any(_run(slots, a, HIGH, 4.0 + i, RULES) for i, a in enumerate(["a1", "a2"] * 5))


def test_a_peer_tiers_idle_adapter_holds_a_tenant_to_its_share_for_claim_s_only() -> None:
    slots = AdapterSlots()
    _run(slots, "peer-1", PEER, 0.0, RULES)
    begin(slots, "a1", HIGH, RULES, 1.0)
    slots.load_done("a1", ok=True)
    assert fit(slots, "a2", HIGH, RULES, 2.0) is None  # the peer's share, while it wants it
    assert fit(slots, "a2", HIGH, RULES, 0.1 + RULES.claim_s + 0.1) == "load"


def test_the_default_claim_is_at_most_half_the_examples_shortest_queue_timeout() -> None:
    # A peer tier's idle claim keeps a request waiting at most claim_s: never its whole queue
    # timeout (docs/adapters.md, "Why claim_s is 5 s").
    config = load_config(Path(__file__).parents[3] / "configs" / "example.yaml").config
    shortest = min(t.queue_timeout_s for t in config.tiers.values())
    assert config.scheduling.adapter_slots.claim_s <= shortest / 2


def test_a_better_tier_cycling_its_adapters_churns_its_own_slot_not_a_worse_tiers() -> None:
    """The worse tier's claim does not hold the better tier back, but while the better tier
    has one of its own idle adapters to give up, it gives up that one."""
    rules = SlotRules(max_loras=2, reserve=0, tenant_cap=1, claim_s=300.0)
    slots = AdapterSlots()
    theirs_loads = 0
    now = 0.0
    for _ in range(10):
        # (The worse tier's request comes first: it never gives up the better tier's claimed
        # adapters, so it would wait for them.)
        theirs_loads += _run(slots, "theirs", LOW, now, rules)
        now += 1.0
        for name in ("s1", "s2", "s3"):
            _run(slots, name, NORMAL, now, rules)
            now += 1.0
    assert theirs_loads == 1


def test_touching_another_tenants_shared_adapter_takes_no_claim_from_it() -> None:
    rules = SlotRules(max_loras=2, reserve=0, tenant_cap=1, claim_s=300.0)
    slots = AdapterSlots()
    now = 0.0
    assert _run(slots, "shared", PEER, now, rules)
    _run(slots, "shared", HIGH, 1.0, rules)  # one 1-token request: it used it last
    shared_loads = 0
    now = 2.0
    for _ in range(10):
        for name in ("c1", "c2", "c3"):
            _run(slots, name, HIGH, now, rules)
            now += 1.0
        shared_loads += _run(slots, "shared", PEER, now, rules)
        now += 1.0
    assert shared_loads == 0  # never given up for the toucher's own adapters
    assert "shared" in slots.held


def test_a_lapsed_claim_is_forgotten() -> None:
    slots = AdapterSlots()
    _run(slots, "x", PEER, 0.0, RULES)
    _run(slots, "x", HIGH, 1.0, RULES)
    assert slots.claims(2.0, 300.0) == {"x": {"peer": 0, "high": 0}}
    assert slots.claims(1.05 + 300.0, 300.0) == {"x": {"high": 0}}
    assert slots.users["x"] == {"high": (1.1, 0)}
