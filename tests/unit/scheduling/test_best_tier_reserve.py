"""The best tier's reserve past a backend's room (finding #21: four long low-tier generations
filled the room and the high tier timed out in the proxy's queue, though the vLLM plugin would
preempt the low tier for it). The dispatcher's mechanism on a fake clock: no sockets, no
sleeps."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from proxy.backends.pool import BackendPool
from proxy.bench.inproc import make_config
from proxy.config.backends import Backend, BackendHealth
from proxy.config.loader import parse_config
from proxy.config.schema import Config
from proxy.policies.backends import LeastUtilised
from proxy.policies.types import QueuedRequest, TierLimits
from proxy.scheduling.build import build_scheduling, default_queue_policies
from proxy.scheduling.dispatch import Dispatcher, Lease, QueueTimeoutError
from proxy.scheduling.queue import AdmissionQueue
from proxy.telemetry.metrics import ProxyMetrics
from tests.helpers.clock import FakeClock


def dispatcher(clock: FakeClock, *, room: int = 4, reserve: int = 1) -> Dispatcher:
    queue = AdmissionQueue(
        {"high": TierLimits(10, 100, 10.0), "low": TierLimits(1, 100, 30.0)},
        default_queue_policies(),
    )
    backend = Backend(url="http://b:1", max_inflight=room)
    pool = BackendPool([backend], BackendHealth(), LeastUtilised())
    pool.best_tiers, pool.best_tier_reserve = frozenset({"high"}), reserve
    return Dispatcher(queue, pool, ProxyMetrics(), clock)


def req(tier: str, clock: FakeClock) -> QueuedRequest:
    return QueuedRequest(
        tier=tier, tenant=tier, prompt_tokens=5, expected_output=5, arrival_s=clock()
    )


def lease(waiter: asyncio.Future[Lease]) -> Lease:
    assert waiter.done()
    return waiter.result()


async def test_the_best_tier_passes_a_room_full_of_worse_tiers(clock: FakeClock) -> None:
    d = dispatcher(clock)
    (state,) = d.pool.all()
    lows = [lease(d.enqueue(req("low", clock))) for _ in range(4)]  # the room is full
    low_waiting = d.enqueue(req("low", clock))
    high = lease(d.enqueue(req("high", clock)))  # at once, through the reserve
    assert high.reserved and high.best and not low_waiting.done()
    assert (state.inflight, state.reserve_inflight) == (5, 1)
    second_high = d.enqueue(req("high", clock))  # the reserve (1) is taken: it waits
    assert not second_high.done()
    lows[0].release()  # back at the room: the reserve is free again, for the best tier only
    assert lease(second_high).reserved and not low_waiting.done()
    assert (state.inflight, state.best_inflight, state.reserve_inflight) == (5, 2, 1)
    high.release()
    assert (state.inflight, state.best_inflight, state.reserve_inflight) == (4, 1, 0)
    assert not low_waiting.done()  # the room is full still: 3 low, 1 high
    lows[1].release()
    assert lease(low_waiting).best is False
    for each in [*lows[2:], lease(second_high), lease(low_waiting)]:
        each.release()
    assert (state.inflight, state.best_inflight, state.reserve_inflight) == (0, 0, 0)


async def test_without_the_reserve_the_best_tier_times_out_behind_them(clock: FakeClock) -> None:
    # Today's main: the room is a hard cap for every tier.
    d = dispatcher(clock, reserve=0)
    for _ in range(4):
        d.enqueue(req("low", clock))
    high = d.enqueue(req("high", clock))
    clock.advance(10.0)
    d.dispatch_ready()
    with pytest.raises(QueueTimeoutError):
        high.result()


@pytest.mark.parametrize("lows", [0, 1])
async def test_the_reserve_is_only_as_large_as_worse_tiers_run_there(
    clock: FakeClock, lows: int
) -> None:
    # Past the room, each best-tier request stands for one worse-tier request the plugin
    # preempts: the best tier alone never over-commits the engine.
    d = dispatcher(clock, reserve=3)
    for _ in range(lows):
        lease(d.enqueue(req("low", clock)))
    for _ in range(4 - lows):
        lease(d.enqueue(req("high", clock)))
    extra = [d.enqueue(req("high", clock)) for _ in range(3)]
    assert sum(w.done() for w in extra) == lows
    assert d.pool.all()[0].inflight == 4 + lows


async def test_a_worse_tier_never_takes_the_reserve(clock: FakeClock) -> None:
    d = dispatcher(clock, reserve=2)
    for _ in range(4):
        lease(d.enqueue(req("low", clock)))
    assert not d.enqueue(req("low", clock)).done()
    assert d.pool.all()[0].inflight == 4


def parse_config_dict(data: dict[str, object]) -> Config:
    return parse_config(yaml.safe_dump(data)).config


def test_the_best_tiers_and_the_reserve_come_from_the_config() -> None:
    data = make_config([{"url": "http://b:1", "max_inflight": 2}])
    config = parse_config_dict(data)
    scheduling = build_scheduling(config, ProxyMetrics())
    assert scheduling.pool.best_tiers == {"high"} and scheduling.pool.best_tier_reserve == 1
    data["scheduling"] = {"best_tier_reserve": 0}
    data["tiers"]["normal"]["priority"] = 0
    scheduling.reconfigure(parse_config_dict(data))
    assert scheduling.pool.best_tiers == {"high", "normal"}
    assert scheduling.pool.best_tier_reserve == 0


def test_a_tier_nobody_is_in_never_holds_the_reserve() -> None:
    """A tenantless tier above every other (a `premium` tier kept for later) would keep the
    reserve from every tenant: the best tier is the best one with tenants."""
    data = make_config([{"url": "http://b:1", "max_inflight": 2}])
    data["tiers"]["premium"] = {**data["tiers"]["high"], "priority": -5}
    scheduling = build_scheduling(parse_config_dict(data), ProxyMetrics())
    assert scheduling.pool.best_tiers == {"high"}
