"""Routing by LoRA adapter on a fake clock (proxy.backends.adapter_slots, the pool's filter and
the dispatcher): a held adapter first, else a load where a slot is free (the least recently used
idle adapter given up), never more distinct adapters in flight on a backend than its max_loras
(the rest wait in the proxy's queue)."""

from __future__ import annotations

import asyncio

from proxy.backends.adapter_rules import SlotRules, begin, fit
from proxy.backends.adapter_slots import AdapterSlots, LoadPlan, SlotUser
from proxy.backends.pool import BackendPool
from proxy.config.backends import Backend, BackendHealth
from proxy.policies.backends import LeastUtilised
from proxy.policies.types import QueuedRequest, TierLimits
from proxy.scheduling.build import default_queue_policies
from proxy.scheduling.dispatch import Dispatcher, Lease
from proxy.scheduling.queue import AdmissionQueue
from proxy.telemetry.metrics import ProxyMetrics
from tests.helpers.clock import FakeClock

USER = SlotUser("tenant")

ADAPTERS = {f"lora-{c}": "tiny" for c in "abcdef"}


def _dispatcher(clock: FakeClock, *backends: Backend) -> Dispatcher:
    queue = AdmissionQueue(
        {"t": TierLimits(1, 100, 60.0)}, default_queue_policies(aging_s=30, reference_tokens=8192)
    )
    pool = BackendPool(backends, BackendHealth(), LeastUtilised())
    pool.adapters = ADAPTERS
    return Dispatcher(queue, pool, ProxyMetrics(), clock)


def _lora_backend(name: str, *, load: bool = True, max_loras: int = 2) -> Backend:
    return Backend(url=f"http://{name}:1", max_inflight=8, max_loras=max_loras, load_adapters=load)


def _loads_done(waiters: list[asyncio.Future[Lease]]) -> None:
    """What the loader does for each dispatched lease with a plan: its load succeeded."""
    for waiter in waiters:
        if waiter.done() and (plan := waiter.result().adapter_plan) is not None:
            lease = waiter.result()
            lease.adapter_plan = None
            if plan.unload is not None:
                lease.backend.adapters.unload_done(plan.unload)
            lease.backend.adapters.load_done(plan.load, ok=True)


def _req(model: str, clock: FakeClock) -> QueuedRequest:
    return QueuedRequest(
        tier="t", tenant=model, prompt_tokens=5, expected_output=5, arrival_s=clock(), model=model
    )


def test_slots_give_up_the_least_recently_used_idle_adapter() -> None:
    slots = AdapterSlots()
    slots.listed(frozenset({"a", "b"}), now=0.0)
    assert begin(slots, "a", USER, SlotRules(2), 1.0) is None  # held: nothing to load
    slots.end("a", USER, 2.0)  # a used last at 2, b at 0
    assert fit(slots, "c", USER, SlotRules(2, True), 0.0) == "load"
    assert begin(slots, "c", USER, SlotRules(2), 3.0) == LoadPlan("c", unload="b")
    assert "c" in slots.loading and "b" not in slots.held
    # A later /v1/models that still lists b (its unload not done yet) does not bring it back.
    slots.listed(frozenset({"a", "b"}), now=4.0)
    assert set(slots.held) == {"a", "c"}
    slots.load_done("c", ok=False)  # a failed load holds nothing
    assert set(slots.held) == {"a"}


def test_nothing_to_give_up_while_every_held_adapter_runs() -> None:
    slots = AdapterSlots()
    for name in ("a", "b"):
        assert begin(slots, name, USER, SlotRules(2), 0.0) == LoadPlan(name)
        slots.load_done(name, ok=True)
    # Two distinct in flight: the slots.
    assert fit(slots, "c", USER, SlotRules(2, True), 0.0) is None
    assert fit(slots, "a", USER, SlotRules(2, True), 0.0) == "has"
    slots.end("b", USER, 1.0)
    assert fit(slots, "c", USER, SlotRules(2, True), 0.0) == "load"
    assert fit(slots, "c", USER, SlotRules(2, False), 0.0) is None  # runtime loading not allowed


def test_a_cancelled_plan_leaves_the_engine_as_it_was() -> None:
    slots = AdapterSlots()
    slots.listed(frozenset({"a", "b"}), now=0.0)
    plan = begin(slots, "c", USER, SlotRules(2), 1.0)
    assert plan is not None
    slots.end("c", USER, 1.0)
    slots.cancel(plan)
    assert set(slots.held) == {"a", "b"} and not slots.loading and not slots.unloading


def test_an_adapter_the_engine_says_it_lacks_is_loaded_again_unless_its_load_runs() -> None:
    slots = AdapterSlots()
    slots.listed(frozenset({"a"}), now=0.0)
    slots.gone("a")  # a 404 from the engine: restarted, or another replica unloaded it
    assert "a" not in slots.held
    assert begin(slots, "a", USER, SlotRules(2), 1.0) == LoadPlan("a")  # the next request loads it
    slots.gone("a")  # a 404 sent before this load: the load under way decides
    assert "a" in slots.held and "a" in slots.loading


async def test_an_adapter_goes_where_it_is_held() -> None:
    clock = FakeClock()
    d = _dispatcher(clock, _lora_backend("x"), _lora_backend("y"))
    d.pool.states["http://y:1"].adapters.listed(frozenset({"lora-a"}), 0.0)
    for _ in range(3):
        lease = await d.enqueue(_req("lora-a", clock))
        assert lease.backend.cfg.url == "http://y:1" and lease.adapter_plan is None


async def test_an_adapter_nobody_holds_is_loaded_where_a_slot_is_free() -> None:
    clock = FakeClock()
    d = _dispatcher(clock, _lora_backend("x", load=False), _lora_backend("y"))
    lease = await d.enqueue(_req("lora-b", clock))
    assert lease.backend.cfg.url == "http://y:1"
    assert lease.adapter_plan == LoadPlan("lora-b")
    # Released before its load began (the client left): the slot is free again.
    lease.release(ran=False)
    assert not d.pool.states["http://y:1"].adapters.held


async def test_never_more_distinct_adapters_in_flight_than_max_loras() -> None:
    clock = FakeClock()
    d = _dispatcher(clock, _lora_backend("x"), _lora_backend("y"))
    waiters = [d.enqueue(_req(name, clock)) for name in ADAPTERS for _ in range(2)]
    await asyncio.sleep(0)

    def distinct() -> dict[str, set[str]]:
        return {url: s.adapters.running() for url, s in d.pool.states.items()}

    assert all(len(names) <= 2 for names in distinct().values())
    started = [w for w in waiters if w.done()]
    assert len(started) == 8  # 2 backends x 2 adapters x 2 requests each
    # As adapters finish, the waiting ones start, never past the slots.
    for _ in range(20):
        _loads_done(waiters)
        done = [w for w in waiters if w.done() and not w.result().released]
        if not done:
            break
        done[0].result().release()
        assert all(len(names) <= 2 for names in distinct().values())
    assert all(w.done() for w in waiters)


async def test_base_model_requests_take_no_adapter_slot() -> None:
    clock = FakeClock()
    d = _dispatcher(clock, _lora_backend("x", max_loras=1))
    first = await d.enqueue(_req("lora-a", clock))
    base = await d.enqueue(_req("tiny", clock))
    assert first.backend is base.backend
    assert first.backend.adapters.running() == {"lora-a"}
    assert not d.enqueue(_req("lora-b", clock)).done()  # its one slot runs lora-a


async def test_an_engine_listing_more_adapters_than_slots_runs_max_loras_at_once() -> None:
    """vLLM started with more --lora-modules than --max-loras would defer the rest inside; the
    proxy holds them in its queue instead."""
    clock = FakeClock()
    d = _dispatcher(clock, _lora_backend("x", load=False))
    state = d.pool.states["http://x:1"]
    state.adapters.listed(frozenset({"lora-a", "lora-b", "lora-c", "lora-d"}), 0.0)
    waiters = [d.enqueue(_req(name, clock)) for name in ("lora-a", "lora-b", "lora-c", "lora-d")]
    assert [w.done() for w in waiters] == [True, True, False, False]
    assert state.adapters.running() == {"lora-a", "lora-b"}
    waiters[0].result().release()
    assert waiters[2].done() and not waiters[3].done()


async def test_a_tenant_whose_requests_overlap_on_one_adapter_lets_a_waiting_one_in() -> None:
    """A tenant that keeps a request in flight on its adapter at every moment would hold an
    engine's slot for ever if its next requests joined the running adapter ahead of another
    tenant's request waiting for the slot; they wait behind it instead, so the waiting one
    starts once the requests already in flight end."""
    clock = FakeClock()
    d = _dispatcher(clock, _lora_backend("x", max_loras=1))
    running = [d.enqueue(_req("lora-a", clock)) for _ in range(2)]
    waiting = d.enqueue(_req("lora-b", clock))
    joins = []
    for _ in range(4):  # one ends, another comes: always one of its requests in flight
        clock.advance(1.0)
        running.pop(0).result().release()
        joins.append(d.enqueue(_req("lora-a", clock)))
        running.extend(j for j in joins[-1:] if j.done())
        if waiting.done():
            break
    assert waiting.done()  # after the two in flight when it came, not after every later one
    assert len(joins) == 2 and not any(j.done() for j in joins)
