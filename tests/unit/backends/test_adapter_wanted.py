"""Wanted adapters stay (proxy.backends.adapter_rules, "Wanted adapters stay"), on plain objects,
the dispatcher and an injected clock: an idle adapter that a tenant's next queued request wants
is given up last, and a request that could only give up such an adapter waits for it, at most
``locality_wait_s`` from its arrival, so the other runs on the adapter held rather than have it
unloaded and loaded again (adapters thrashing through the slots in the queue's order)."""

from __future__ import annotations

import asyncio

from proxy.backends.adapter_choice import adapter_able
from proxy.backends.adapter_rules import AdapterPolicy, SlotRules, begin, fit
from proxy.backends.adapter_slots import AdapterSlots, LoadPlan, SlotUser
from proxy.backends.pool import BackendPool
from proxy.config.backends import Backend, BackendHealth
from proxy.config.scheduling import AdapterSlotKnobs
from proxy.policies.backends import LeastUtilised
from proxy.policies.types import QueuedRequest, TierLimits
from proxy.scheduling.build import default_queue_policies
from proxy.scheduling.dispatch import Dispatcher, Lease
from proxy.scheduling.queue import AdmissionQueue
from proxy.telemetry.metrics import ProxyMetrics
from tests.helpers.clock import FakeClock

RULES = SlotRules(max_loras=2, claim_s=5.0)
ADAPTERS = {f"lora-{c}": "tiny" for c in "abcd"}


def _held(*names: str, demand: dict[str, int]) -> AdapterSlots:
    slots = AdapterSlots()
    slots.listed(frozenset(names), 0.0)
    slots.new_pass(demand.get)
    return slots


def test_an_idle_adapter_nobody_waits_for_is_given_up_before_a_wanted_one() -> None:
    slots = _held("a", "b", demand={"a": 0})  # "a" is the least recently used, and wanted
    slots.held["a"] = -1.0
    user = SlotUser("t", rank=0, patient_until=10.0)
    assert begin(slots, "c", user, RULES, 1.0) == LoadPlan("c", unload="b")


def test_a_request_waits_rather_than_give_up_the_only_idle_adapter_a_peer_wants() -> None:
    slots = _held("a", "b", demand={"a": 0, "b": 0})
    user = SlotUser("t", rank=0, patient_until=2.0)
    assert fit(slots, "c", user, RULES, 1.0) is None
    # Its patience is over: it loads, the least recently used wanted adapter going.
    assert fit(slots, "c", user, RULES, 2.0) == "load"


def test_a_worse_tiers_wish_never_makes_a_better_tier_wait() -> None:
    slots = _held("a", "b", demand={"a": 10, "b": 10})  # wanted by the low tier only
    assert fit(slots, "c", SlotUser("hi", rank=0, patient_until=9.0), RULES, 1.0) == "load"
    assert fit(slots, "c", SlotUser("lo", rank=10, patient_until=9.0), RULES, 1.0) is None


def test_a_request_sparing_a_wanted_adapter_holds_back_no_join_and_notes_its_patience() -> None:
    backend = Backend(url="http://x:1", max_loras=2, load_adapters=True)
    pool = BackendPool([backend], BackendHealth(), LeastUtilised())
    pool.adapters = ADAPTERS
    state = next(iter(pool.states.values()))
    state.adapters.listed(frozenset({"lora-a", "lora-b"}), 0.0)
    state.adapters.new_pass({"lora-a": 0, "lora-b": 0}.get)
    user = SlotUser("t", rank=0, patient_until=3.0)
    able = adapter_able(pool.all(), ADAPTERS, "lora-c", AdapterPolicy(), user, 1.0)
    assert able == (set(), set())
    assert not state.adapters.waiting  # a wait for a slot would stop others joining
    assert state.adapters.patience_ends == 3.0


def _dispatcher(
    clock: FakeClock, locality_wait_s: float, max_loras: int = 2, max_inflight: int = 8
) -> Dispatcher:
    queue = AdmissionQueue(
        {"t": TierLimits(1, 100, 60.0)}, default_queue_policies(aging_s=30, reference_tokens=8192)
    )
    backend = Backend(
        url="http://x:1", max_inflight=max_inflight, max_loras=max_loras, load_adapters=True
    )
    pool = BackendPool([backend], BackendHealth(), LeastUtilised())
    pool.adapters = ADAPTERS
    pool.adapter_policy = AdapterPolicy(AdapterSlotKnobs(locality_wait_s=locality_wait_s))
    return Dispatcher(queue, pool, ProxyMetrics(), clock)


def _req(model: str, tenant: str, clock: FakeClock) -> QueuedRequest:
    return QueuedRequest(
        tier="t", tenant=tenant, prompt_tokens=5, expected_output=5, arrival_s=clock(), model=model
    )


def _serve(d: Dispatcher, clock: FakeClock, waiters: list[asyncio.Future[Lease]]) -> int:
    """Run the queue dry: each started request's load succeeds, then it ends 1 s on, one by
    one; the loads it took."""
    loads = 0
    for _ in range(40):
        started = [w.result() for w in waiters if w.done() and not w.result().released]
        if not started:
            clock.advance(1.0)
            d.dispatch_ready()
            if all(w.done() for w in waiters):
                return loads
            continue
        lease = started[0]
        if (plan := lease.adapter_plan) is not None:
            loads += 1
            lease.adapter_plan = None
            if plan.unload is not None:
                lease.backend.adapters.unload_done(plan.unload)
            lease.backend.adapters.load_done(plan.load, ok=True)
        clock.advance(1.0)
        lease.release()
    raise AssertionError("the queue never ran dry")


def _burst(locality_wait_s: float) -> int:
    """The engine holds lora-a and lora-b, idle, and has room for two requests, both taken by
    base-model requests; a third tenant's request for lora-c comes first, then one for each
    held adapter: the loads the queue takes to run dry once the base-model requests end."""
    clock = FakeClock()
    d = _dispatcher(clock, locality_wait_s, max_inflight=2)
    state = next(iter(d.pool.states.values()))
    state.adapters.listed(frozenset({"lora-a", "lora-b"}), clock())
    base = [d.enqueue(_req("tiny", "base", clock)) for _ in range(2)]
    # Tenants new to the queue tie: the fairness order takes them by name, lora-c's first.
    later = [d.enqueue(_req(f"lora-{c}", f"t{i}", clock)) for i, c in enumerate("cab")]
    assert all(w.done() for w in base) and not any(w.done() for w in later)
    for waiter in base:
        clock.advance(0.1)
        waiter.result().release()
    return _serve(d, clock, later)


async def test_a_burst_reloads_no_adapter_that_a_waiting_request_wants() -> None:
    # In the queue's order lora-c goes first and gives up lora-a, whose request then gives up
    # lora-b, whose request then loads it again: three loads. Sparing the wanted adapters,
    # lora-a's and lora-b's requests run on them and lora-c loads once, into the first slot
    # that frees.
    assert _burst(locality_wait_s=0.0) == 3
    assert _burst(locality_wait_s=1.0) == 1


async def test_a_request_whose_wanted_adapter_cannot_run_waits_only_its_patience() -> None:
    """The tenant whose next request wants the idle adapter is at its share of the engine's
    slots, so that request cannot start: another tenant's load spares the adapter for its
    patience only, then gives it up."""
    clock = FakeClock()
    d = _dispatcher(clock, locality_wait_s=2.0, max_loras=3)
    for model, tenant in (("lora-d", "ta"), ("lora-b", "tb")):  # long generations
        lease = d.enqueue(_req(model, tenant, clock)).result()
        assert lease.adapter_plan is not None
        lease.backend.adapters.load_done(lease.adapter_plan.load, ok=True)
        lease.adapter_plan = None
    state = next(iter(d.pool.states.values()))
    state.adapters.listed(frozenset({"lora-a", "lora-b", "lora-d"}), clock())
    held_back = d.enqueue(_req("lora-a", "ta", clock))  # ta's share: one adapter at a time
    waiter = d.enqueue(_req("lora-c", "tc", clock))
    assert not held_back.done() and not waiter.done()
    clock.advance(1.9)
    d.dispatch_ready()
    assert not waiter.done()
    clock.advance(0.2)
    d.dispatch_ready()
    assert waiter.done()
    assert waiter.result().adapter_plan == LoadPlan("lora-c", unload="lora-a")
