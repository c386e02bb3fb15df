"""A due adapter request (proxy.backends.adapter_rules, "Due"), on the dispatcher and an
injected clock: better tiers that keep every slot of an engine busy hold a worse tier's adapter
request for ``due_share`` of its queue timeout, then the engine lets it in (nobody joins or
starts an adapter ahead of it, and it may unload a better tier's idle adapter), instead of
holding it to its timeout whatever the tiers' weights (found running benchmarks/adapters_bench.py
with two clients per tenant: the low tier's first token after 37 s, at the end of the run)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.backends.adapter_rules import AdapterPolicy, SlotRules, begin, fit, waits_for_slot
from proxy.backends.adapter_slots import AdapterSlots, SlotUser
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

ADAPTERS = {f"lora-{c}": "tiny" for c in "abc"}
RULES = SlotRules(max_loras=2, reserve=1, tenant_cap=1, claim_s=5.0)
HI1 = SlotUser("hi1", best=True, rank=0)
HI2 = SlotUser("hi2", best=True, rank=0)


def test_a_due_request_may_unload_a_better_tiers_idle_adapter() -> None:
    slots = AdapterSlots()
    slots.listed(frozenset({"lora-a", "lora-b"}), 0.0)
    for name, user in (("lora-a", HI1), ("lora-b", HI2)):  # both used: claimed for claim_s
        slots.begin(name, user, None, 1.0)
        slots.end(name, user, 1.5)
    low = SlotUser("lo", best=False, rank=10)
    assert fit(slots, "lora-c", low, RULES, 2.0) is None
    assert not waits_for_slot(slots, "lora-c", low, RULES, 2.0)  # better tiers' claims
    due = SlotUser("lo", best=False, rank=10, due=True)
    assert fit(slots, "lora-c", due, RULES, 2.0) == "load"


def _dispatcher(clock: FakeClock, due_share: float) -> Dispatcher:
    tiers = {"high": TierLimits(1000, 100, 60.0, priority=0), "low": TierLimits(1, 100, 10.0, 10)}
    queue = AdmissionQueue(tiers, default_queue_policies(aging_s=30, reference_tokens=8192))
    backend = Backend(url="http://x:1", max_inflight=8, max_loras=2, load_adapters=True)
    pool = BackendPool([backend], BackendHealth(), LeastUtilised())
    pool.adapters = ADAPTERS
    pool.best_tiers = frozenset({"high"})
    knobs = AdapterSlotKnobs(due_share=due_share)
    pool.adapter_policy = AdapterPolicy(knobs, frozenset(), {"high": 0, "low": 10})
    return Dispatcher(queue, pool, ProxyMetrics(), clock)


def _req(tier: str, tenant: str, model: str, clock: FakeClock) -> QueuedRequest:
    return QueuedRequest(
        tier=tier, tenant=tenant, prompt_tokens=5, expected_output=5, arrival_s=clock(), model=model
    )


def _loaded(waiter: asyncio.Future[Lease]) -> int:
    """Its load (if any) done at once; 1 if it had one."""
    if not waiter.done() or isinstance(waiter.exception(), Exception):
        return 0
    lease = waiter.result()
    plan, lease.adapter_plan = lease.adapter_plan, None
    if plan is None:
        return 0
    if plan.unload is not None:
        lease.backend.adapters.unload_done(plan.unload)
    lease.backend.adapters.load_done(plan.load, ok=True)
    return 1


def _busy_high_tiers_and_one_low_request(due_share: float) -> tuple[float | None, int]:
    """Two high-tier tenants keep one request each in flight on their own adapter at every
    moment (each request runs 2 s, the next is queued just before it ends); a low-tier request for a third
    adapter comes at 0.5 s (queue timeout 10 s). When it started (None: it timed out), and the
    high tenants' adapter loads after their first two."""
    clock = FakeClock()
    d = _dispatcher(clock, due_share)
    running = {
        t: d.enqueue(_req("high", t, f"lora-{a}", clock)) for t, a in (("h1", "a"), ("h2", "b"))
    }
    loads = sum(_loaded(w) for w in running.values())
    t0 = clock()
    clock.advance(0.5)
    low = d.enqueue(_req("low", "lo", "lora-c", clock))
    started: float | None = None
    for tick in range(1, 30):
        clock.advance(0.5)
        if tick % 2 == 0:  # every second a request ends, each tenant's in turn (2 s each)
            tenant = ("h1", "h2")[(tick // 2) % 2]
            done = running[tenant].result()
            model = {"h1": "lora-a", "h2": "lora-b"}[tenant]
            # Its next request is queued before this one ends (a client with two in flight).
            running[tenant] = d.enqueue(_req("high", tenant, model, clock))
            done.release()
        d.dispatch_ready()
        if low.done() and started is None and low.exception() is None:
            started = clock() - t0
            _loaded(low)
            low.result().release()
        for waiter in running.values():
            loads += _loaded(waiter)
    if not low.done():
        pytest.fail("the low request neither started nor timed out")
    return started, loads - 2


async def test_a_worse_tier_waits_its_due_share_not_its_timeout() -> None:
    strict, strict_reloads = _busy_high_tiers_and_one_low_request(due_share=1.0)
    assert strict is None and strict_reloads == 0  # held to its timeout: 503 queue_timeout
    started, reloads = _busy_high_tiers_and_one_low_request(due_share=0.5)
    assert started is not None
    assert 0.5 + 5.0 <= started <= 0.5 + 10.0  # due after half its 10 s, served before 10 s
    assert reloads == 1  # the one high adapter it unloaded, loaded again once


def test_a_begin_the_rules_would_not_allow_still_keeps_max_loras() -> None:
    """A caller whose view differs from ``fit``'s (as the dispatcher's did before it passed
    the request's wait to ``acquire``: a third adapter registered on a two-slot engine) still
    gives up the least recently used idle adapter."""
    slots = AdapterSlots()
    slots.listed(frozenset({"lora-a", "lora-b"}), 0.0)
    for name, user in (("lora-a", HI1), ("lora-b", HI2)):
        slots.begin(name, user, None, 1.0)
        slots.end(name, user, 1.5)
    plan = begin(slots, "lora-c", SlotUser("lo", best=False, rank=10), RULES, 2.0)
    assert plan is not None and plan.unload is not None
    assert len(slots.held) == 2


async def test_a_due_request_a_token_hold_refuses_does_not_keep_the_holder_from_its_adapter() -> (
    None
):
    """A request held back by another's token hold turned due and was noted waiting for an
    adapter slot there; the holder was then refused its own idle adapter for that due request,
    and both waited on an idle engine until the holder's queue timeout (red team A1, stop 51).
    A due request is noted only where no hold keeps it."""
    clock = FakeClock()
    tiers = {"high": TierLimits(1000, 100, 60.0, priority=0), "normal": TierLimits(5, 100, 14.0, 5)}
    queue = AdmissionQueue(tiers, default_queue_policies(aging_s=30, reference_tokens=8192))
    backend = Backend(
        url="http://x:1",
        max_inflight=8,
        max_loras=2,
        load_adapters=True,
        max_tokens_inflight=10_000,
    )
    pool = BackendPool([backend], BackendHealth(), LeastUtilised())
    pool.adapters = ADAPTERS
    pool.best_tiers = frozenset({"high"})
    ranks = {"high": 0, "normal": 5}
    pool.adapter_policy = AdapterPolicy(AdapterSlotKnobs(due_share=0.5), frozenset(), ranks)
    pool.token_reservations.ranks, pool.token_reservations.is_next = ranks, queue.is_next
    pool.all()[0].adapters.listed(frozenset({"lora-a", "lora-b"}), 0.0)
    d = Dispatcher(queue, pool, ProxyMetrics(), clock)

    def sized(tenant: str, model: str, tokens: int) -> QueuedRequest:
        half = tokens // 2
        return QueuedRequest(
            tier="normal",
            tenant=tenant,
            prompt_tokens=half,
            expected_output=tokens - half,
            arrival_s=clock(),
            model=model,
        )

    alone = d.enqueue(sized("w", "tiny", 12_000))  # past the whole budget: runs alone
    held = d.enqueue(sized("x", "lora-a", 2_500))  # does not fit: holds the backend
    clock.advance(0.5)
    due = d.enqueue(sized("v", "lora-c", 50))  # held back; due after half its 14 s
    assert alone.done() and not held.done() and not due.done()
    clock.advance(7.5)
    d.dispatch_ready()
    assert not due.done()  # due now, and still held back by x's hold
    alone.result().release()  # idle: the holder goes, to its own idle adapter
    assert held.done() and held.exception() is None
    assert held.result().adapter_plan is None  # lora-a was loaded: no load needed
