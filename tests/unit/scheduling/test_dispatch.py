"""The dispatcher's mechanism on a fake clock: no sockets, no sleeps."""

from __future__ import annotations

import asyncio

import pytest

from proxy.backends.pool import BackendPool
from proxy.config.backends import Backend, BackendHealth
from proxy.policies.backends import LeastUtilised
from proxy.policies.kvaware import KvAware
from proxy.policies.types import QueuedRequest, ScrapedLoad, TierLimits
from proxy.scheduling.build import default_queue_policies
from proxy.scheduling.dispatch import Dispatcher, Lease, QueueTimeoutError
from proxy.scheduling.queue import AdmissionQueue, QueueFull
from proxy.telemetry.metrics import ProxyMetrics
from tests.helpers.clock import FakeClock


def _dispatcher(slots: int, cap: int, clock: FakeClock) -> Dispatcher:
    queue = AdmissionQueue(
        {"low": TierLimits(1, cap, 5.0), "high": TierLimits(10, cap, 5.0)},
        default_queue_policies(aging_s=30, reference_tokens=8192),
    )
    pool = BackendPool(
        [Backend(url="http://b:1", max_inflight=slots)], BackendHealth(), LeastUtilised()
    )
    return Dispatcher(queue, pool, ProxyMetrics(), clock)


def _req(tier: str, clock: FakeClock) -> QueuedRequest:
    return QueuedRequest(
        tier=tier, tenant="t", prompt_tokens=5, expected_output=5, arrival_s=clock()
    )


async def test_burst_uses_the_free_slot_before_counting_against_the_cap() -> None:
    clock = FakeClock()
    d = _dispatcher(slots=1, cap=3, clock=clock)
    waiters = [d.enqueue(_req("low", clock)) for _ in range(4)]  # one runs, three wait
    assert waiters[0].done() and not any(w.done() for w in waiters[1:])
    with pytest.raises(QueueFull):
        d.enqueue(_req("low", clock))
    # Releasing the slot hands it on at once, to the next by policy.
    high = d.enqueue(_req("high", clock), force=True)
    waiters[0].result().release()
    assert high.done() and not waiters[1].done()


async def test_a_lease_released_at_the_backends_end_dates_the_backends_part_then() -> None:
    """The relay releases a lease once the backend's answer is read whole, while a slow client
    still reads the rest: the backend's latency (its room controller's) ends at the release."""
    clock = FakeClock()
    lease = _dispatcher(slots=1, cap=1, clock=clock).enqueue(_req("low", clock)).result()
    clock.now += 2.0
    assert lease.backend_end(clock()) == clock()  # not released: its part runs on
    lease.release()
    released = clock()
    clock.now += 30.0  # the client drains the read-ahead
    lease.release()  # the pipeline's own release, at the relay's end: changes nothing
    assert lease.backend_end(clock()) == released


async def test_expired_waiters_get_queue_timeout_and_leave_nothing() -> None:
    clock = FakeClock()
    d = _dispatcher(slots=1, cap=10, clock=clock)
    running = d.enqueue(_req("low", clock))
    waiting = d.enqueue(_req("low", clock))
    clock.now += 5.0
    d.dispatch_ready()
    with pytest.raises(QueueTimeoutError):
        waiting.result()
    assert len(d.queue) == 0
    running.result().release()
    assert d.pool.all()[0].inflight == 0


async def test_withdraw_queued_or_already_dispatched() -> None:
    clock = FakeClock()
    d = _dispatcher(slots=1, cap=10, clock=clock)
    first, second = _req("low", clock), _req("low", clock)
    w1 = d.enqueue(first)
    d.enqueue(second)
    d.withdraw(second)  # client left while queued
    assert len(d.queue) == 0
    d.withdraw(first)  # client left right after dispatch: its slot comes back
    assert isinstance(w1.result(), Lease) and w1.result().released
    assert d.pool.all()[0].inflight == 0


async def test_dispatcher_task_wakes_for_deadlines_and_stops_cleanly() -> None:
    clock = FakeClock()
    d = _dispatcher(slots=1, cap=10, clock=clock)
    d.start()
    d.enqueue(_req("low", clock))
    waiting = d.enqueue(_req("low", clock))
    clock.now += 10
    d.kick()
    with pytest.raises(QueueTimeoutError):
        await asyncio.wait_for(waiting, 10.0)  # at once by the fake clock; never, were it lost
    await d.stop()


async def test_a_displaced_waiter_gets_queue_full_and_its_slot_goes_to_the_newcomer() -> None:
    clock = FakeClock()
    d = _dispatcher(slots=1, cap=2, clock=clock)
    running = d.enqueue(_req("low", clock))
    flood = [d.enqueue(_req("low", clock)) for _ in range(2)]
    other = _req("low", clock)
    other.tenant = "other"
    mine = d.enqueue(other)
    with pytest.raises(QueueFull) as exc:
        flood[-1].result()
    assert exc.value.displaced and not flood[0].done() and not mine.done()
    running.result().release()
    running2 = flood[0] if flood[0].done() else mine
    running2.result().release()
    assert flood[0].done() and mine.done() and len(d.queue) == 0


def _kv_dispatcher(clock: FakeClock, hold_s: float = 1.0) -> Dispatcher:
    """Two backends of one slot each, ``kv_aware`` with a hold of ``hold_s`` for the worst
    tier."""
    queue = AdmissionQueue(
        {"low": TierLimits(1, 10, 30.0), "high": TierLimits(10, 10, 30.0)},
        default_queue_policies(aging_s=30, reference_tokens=8192),
    )
    chooser = KvAware(
        block_size=32, latency_weights={"high": 1.0, "low": 0.1}, hold_s=hold_s, clock=clock
    )
    backends = [Backend(url=f"http://b{i}:1", max_inflight=1) for i in range(2)]
    return Dispatcher(queue, BackendPool(backends, BackendHealth(), chooser), ProxyMetrics(), clock)


def _turn(tenant: str, blocks: range, clock: FakeClock) -> QueuedRequest:
    req = QueuedRequest(
        tier="low", tenant=tenant, prompt_tokens=32 * len(blocks), expected_output=5,
        arrival_s=clock(),
    )  # fmt: skip
    req.prompt_blocks = tuple(blocks)
    return req


async def test_a_request_held_for_its_busy_home_lets_the_next_one_take_the_free_slot() -> None:
    clock = FakeClock()
    d = _kv_dispatcher(clock)
    home, spare = d.pool.all()
    first = d.enqueue(_turn("x", range(30), clock))
    assert first.result().backend is home
    # x's next turn would compute 30 blocks again on the spare backend: it waits for home...
    held = d.enqueue(_turn("x", range(40), clock))
    assert not held.done() and spare.inflight == 0
    # ... and the next request in line (nothing cached anywhere) takes the spare slot.
    other = d.enqueue(_turn("y", range(100, 110), clock))
    assert other.result().backend is spare
    # Home's slot frees: the held turn goes there at once.
    first.result().release()
    assert held.result().backend is home


async def test_a_hold_ends_with_time_even_if_its_home_never_frees() -> None:
    clock = FakeClock()
    # The task sleeps until the hold's end by the injected clock (50 ms, which it also waits in
    # real time); nothing frees a slot or kicks it meanwhile.
    d = _kv_dispatcher(clock, hold_s=0.05)
    _, spare = d.pool.all()
    d.enqueue(_turn("x", range(30), clock))  # holds home's slot all along
    d.start()
    held = d.enqueue(_turn("x", range(40), clock))
    await asyncio.sleep(0.01)
    assert not held.done()
    clock.now += 0.06
    lease = await asyncio.wait_for(held, 10.0)  # no kick: the task's own wake-up
    assert lease.backend is spare
    await d.stop()


class _PicksOnce(LeastUtilised):
    """A chooser with effects: its first pick for a request is its backend, a second None
    (as an adapter's wait, or a hold, noted by the first pick can make it)."""

    def __init__(self) -> None:
        super().__init__()
        self.picked: set[int] = set()

    def pick(self, candidates, request, *, now=None, full=()):  # type: ignore[no-untyped-def]
        if request is not None and id(request) in self.picked:
            return None
        if request is not None:
            self.picked.add(id(request))
        return super().pick(candidates, request, now=now, full=full)


async def test_the_pick_that_lets_a_request_out_of_the_queue_is_the_backend_it_gets() -> None:
    # Found by the engine suite (adapters): the dispatcher picked again after the pop, got
    # None, and raised: a 500 for one client, the popped request never leased (the other
    # client waited out its 600 s timeout).
    clock = FakeClock()
    queue = AdmissionQueue(
        {"low": TierLimits(1, 10, 5.0), "high": TierLimits(10, 10, 5.0)},
        default_queue_policies(aging_s=30, reference_tokens=8192),
    )
    pool = BackendPool([Backend(url="http://b:1", max_inflight=1)], BackendHealth(), _PicksOnce())
    d = Dispatcher(queue, pool, ProxyMetrics(), clock)
    first = d.enqueue(_req("low", clock))
    second = d.enqueue(_req("low", clock))  # queued: the one slot is taken
    assert first.done() and not second.done()
    first.result().release()  # dispatch_ready pops the second: one pick, used as is
    assert second.done() and isinstance(second.result(), Lease)
    assert len(d.queue) == 0
    second.result().release()
    assert pool.all()[0].inflight == 0


def _budget_dispatcher(clock: FakeClock) -> Dispatcher:
    """One backend of 8 slots and 1,000 tokens in flight; tiers ranked as a config would."""
    queue = AdmissionQueue(
        {"low": TierLimits(1, 100, 60.0, priority=1), "high": TierLimits(10, 100, 60.0)},
        default_queue_policies(aging_s=30, reference_tokens=8192),
    )
    backend = Backend(url="http://b:1", max_inflight=8, max_tokens_inflight=1000)
    pool = BackendPool([backend], BackendHealth(), LeastUtilised())
    pool.token_reservations.ranks = {"high": 0, "low": 1}
    pool.token_reservations.is_next = queue.is_next
    pool.best_tiers, pool.best_tier_reserve = frozenset({"high"}), 1
    return Dispatcher(queue, pool, ProxyMetrics(), clock)


def _sized(tier: str, tenant: str, tokens: int, clock: FakeClock) -> QueuedRequest:
    return QueuedRequest(
        tier=tier,
        tenant=tenant,
        prompt_tokens=tokens // 2,
        expected_output=tokens - tokens // 2,
        arrival_s=clock(),
    )


async def test_a_request_the_token_budget_does_not_fit_drains_a_backend_under_steady_load() -> None:
    """Another tenant's steady 300-token requests keep 900 of 1,000 tokens in flight: without a
    hold each freed 300 went to the next of them, and the 900-token request waited out its
    queue timeout (red team, stop 50). Held, the backend takes nothing else of its tier until
    it fits; then the flood goes on."""
    clock = FakeClock()
    d = _budget_dispatcher(clock)
    running = [d.enqueue(_sized("low", "flood", 300, clock)) for _ in range(3)]
    assert all(w.done() for w in running)
    backlog = [d.enqueue(_sized("low", "flood", 300, clock)) for _ in range(20)]
    big = d.enqueue(_sized("low", "batch", 900, clock))
    assert not big.done() and not any(w.done() for w in backlog)
    # The flood's next request was refused for tokens first: it holds the backend until it fits.
    clock.now += 1.0
    running.pop(0).result().release()
    running += [w for w in backlog if w.done()]
    assert len(running) == 3  # it went; then the batch request holds the backend
    held = d.pool.token_reservations.holder("http://b:1")
    assert held is not None and held.tenant == "batch"
    for lease in running[:2]:  # 600, then 300 in flight: no flood request goes in
        clock.now += 1.0
        lease.result().release()
        assert sum(w.done() for w in backlog) == 1 and not big.done()
    clock.now += 1.0
    running[2].result().release()  # idle: it fits
    assert big.done() and big.result().backend.tokens_inflight == 900
    held = d.pool.token_reservations.holder("http://b:1")  # the flood's next, which 900 leaves out
    assert held is not None and held.tenant == "flood"
    big.result().release()
    assert sum(w.done() for w in backlog) == 1 + 3  # the flood goes on, three at a time


async def test_a_better_tier_passes_a_worse_tiers_drain() -> None:
    clock = FakeClock()
    d = _budget_dispatcher(clock)
    running = [d.enqueue(_sized("low", "flood", 300, clock)) for _ in range(3)]
    flood = d.enqueue(_sized("low", "flood", 100, clock))  # fits: 1,000 in flight
    big = d.enqueue(_sized("low", "batch", 900, clock))
    assert flood.done() and not big.done()
    more = d.enqueue(_sized("low", "flood", 50, clock))
    interactive = d.enqueue(_sized("high", "chat", 50, clock))
    running[0].result().release()  # 700 in flight: the high-tier request passes, the low one waits
    assert interactive.done() and not more.done() and not big.done()
    held = d.pool.token_reservations.holder("http://b:1")
    assert held is not None and held.tenant == "batch"  # the drain goes on for it


async def test_a_drain_ends_when_its_request_leaves_the_queue() -> None:
    clock = FakeClock()
    d = _budget_dispatcher(clock)
    [d.enqueue(_sized("low", "flood", 300, clock)) for _ in range(3)]
    big = _sized("low", "batch", 900, clock)
    d.enqueue(big)
    queued = d.enqueue(_sized("low", "flood", 100, clock))
    assert not queued.done()  # 1,000 would fit, but the backend drains for the batch request
    d.withdraw(big)  # its client left
    d.dispatch_ready()
    assert queued.done() and d.pool.token_reservations.held() == {}


async def test_a_hold_lapses_while_its_tenant_sends_a_request_ahead_of_it() -> None:
    """A shorter request of the holder's own tenant goes ahead of it (short first): the held
    request is no longer tried, and its hold kept the backend idle for every tenant of its tier
    until it timed out (red team F1, stop 51). The hold lasts while its request is next."""
    clock = FakeClock()
    d = _budget_dispatcher(clock)
    first = d.enqueue(_sized("low", "x", 600, clock))
    held = _sized("low", "x", 700, clock)
    d.enqueue(held)
    assert first.done() and d.pool.token_reservations.holder("http://b:1") is held
    short = d.enqueue(_sized("low", "x", 10, clock))  # x's next now: it goes
    assert short.done()
    others = [d.enqueue(_sized("low", "v", 50, clock)) for _ in range(3)]
    assert d.pool.token_reservations.holder("http://b:1") is held  # x's next again: it holds
    assert not any(w.done() for w in others)
    first.result().release()
    assert d.pool.token_reservations.holder("http://b:1") is None
    assert all(w.done() for w in others)  # 10 + 700 + 150 in flight


async def test_the_best_tier_passes_the_token_budget_a_worse_tier_fills() -> None:
    """A worse tier's request past the whole budget runs alone: every other request waited
    until it ended, the best tier's too (red team F2, stop 51). The best tier counts only its
    own tokens, as it takes a reserve slot; a worse tier still waits."""
    clock = FakeClock()
    d = _budget_dispatcher(clock)
    huge = d.enqueue(_sized("low", "batch", 5000, clock))
    assert huge.done()  # idle: it runs, past the budget
    normal = d.enqueue(_sized("low", "v", 50, clock))
    urgent = d.enqueue(_sized("high", "chat", 50, clock))
    assert urgent.done() and not normal.done()
    d.pool.best_tier_reserve = 0  # the reserve off: the budget is a hard cap for every tier
    later = d.enqueue(_sized("high", "chat", 50, clock))
    assert not later.done()


async def test_a_hold_blocks_nobody_while_vllm_runs_nothing_the_proxy_counts() -> None:
    """A stream whose client stopped reading is done in vLLM but keeps its tokens until the
    relay cuts it (30 s): with a hold on the backend, every request of its tier waited that long
    on an idle engine (red team S1, stop 51). Once scrapes show vLLM running nothing the proxy
    counts there, the hold lets the requests that fit go; its own request still waits."""
    clock = FakeClock()
    d = _budget_dispatcher(clock)
    stalled = d.enqueue(_sized("low", "x", 600, clock))  # done in vLLM, its client not reading
    big = _sized("low", "v", 700, clock)
    d.enqueue(big)
    small = d.enqueue(_sized("low", "w", 50, clock))
    assert stalled.done() and not small.done()
    state = d.pool.all()[0]
    idle = ScrapedLoad(waiting=0, running=0, kv_usage=0.0, at=clock())
    state.scraped(idle)
    clock.now += 0.5
    state.scraped(ScrapedLoad(waiting=0, running=0, kv_usage=0.0, at=clock()))
    d.dispatch_ready()
    assert not small.done()  # one scrape's interval: a relay's last bytes, maybe
    clock.now += 0.6
    state.scraped(ScrapedLoad(waiting=0, running=0, kv_usage=0.0, at=clock()))
    d.dispatch_ready()
    assert small.done() and d.pool.token_reservations.holder("http://b:1") is big
    later = d.enqueue(_sized("low", "w", 50, clock))
    assert not later.done()  # vLLM has work again: the hold holds until a scrape says not
