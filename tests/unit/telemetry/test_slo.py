"""Tier SLOs: config, goodput metrics, early refusal, and the room metrics of the monitor."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import yaml

from proxy.api.errors import refused_early
from proxy.api.outcome import Outcome, outcome_of
from proxy.backends.monitor import BackendMonitor
from proxy.backends.pool import BackendPool
from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import make_config, until
from proxy.config.backends import Backend, BackendHealth
from proxy.config.loader import ConfigError, parse_config
from proxy.policies.backends import LeastUtilised
from proxy.policies.types import QueuedRequest, ScrapedLoad, TierLimits
from proxy.scheduling.build import default_queue_policies
from proxy.scheduling.dispatch import Dispatcher, Lease
from proxy.scheduling.early_refusal import EarlyRefusal
from proxy.scheduling.queue import AdmissionQueue
from proxy.telemetry.metrics import ProxyMetrics
from tests.helpers.clock import FakeClock
from tests.helpers.rig import rig, tenants

SLO = {"ttft_s": 5.0, "itl_s": 1.0, "percentile": 95}


def test_config_reads_slo_and_adaptive_room() -> None:
    cfg = make_config([{"url": "http://a:1"}, {"url": "http://b:1", "max_inflight": 8}])
    cfg["tiers"]["high"]["slo"] = SLO
    cfg["tiers"]["high"]["early_refusal"] = True
    loaded = parse_config(yaml.safe_dump(cfg)).config
    high = loaded.tiers["high"]
    assert high.slo is not None and high.slo.ttft_s == 5.0 and high.early_refusal
    assert [b.adaptive_room for b in loaded.backends] == [True, False]
    assert loaded.adaptive_room.initial_room == 8
    cfg["tiers"]["high"]["slo"] = {"percentile": 90}
    cfg["backends"][1]["adaptive"] = False
    cfg["backends"][1].pop("max_inflight")
    with pytest.raises(ConfigError) as err:
        parse_config(yaml.safe_dump(cfg))
    text = str(err.value)
    assert "tiers.high.slo" in text and "give ttft_s, itl_s or both" in text
    assert "adaptive: false needs max_inflight" in text


# -- goodput -----------------------------------------------------------------------------------


async def test_goodput_counts_met_and_missed_per_tier_and_tenant(clock: FakeClock) -> None:
    backend = FakeVLLM(usage=(7, 3))
    async with backend.serve() as url:
        config = make_config(
            [{"url": url, "max_inflight": 1}],
            tiers={"normal": {"slo": SLO, "queue_timeout_s": 10}},
            tenants=tenants(),
        )
        async with rig(config, clock) as r:
            labels = {"tier": "normal", "tenant": "tenant-normal"}
            assert (await r.chat()).status == 200  # no time passes: met
            backend.gate.clear()
            slow = asyncio.create_task(r.chat())
            await until(lambda: backend.active == 1, 5, "the slow request at the backend")
            clock.advance(6.0)  # its first token comes 6 s after arrival: over ttft_s 5
            queued = asyncio.create_task(r.chat())
            await until(lambda: len(r.state.queue) == 1, 5, "the third request queued")
            await r.advance(10.0)
            assert (await queued).status == 503  # a queue timeout is a miss too
            backend.gate.set()
            assert (await slow).status == 200
            assert r.metric("tierproxy_slo_requests_total", labels) == 3
            assert r.metric("tierproxy_slo_met_total", labels) == 1
            # A tier without an slo is not counted.
            assert (await r.chat("high")).status == 200
            high = {"tier": "high", "tenant": "tenant-high"}
            assert r.metric("tierproxy_slo_requests_total", high) == 0


# -- early refusal -----------------------------------------------------------------------------


def _dispatcher(clock: FakeClock, early: bool) -> Dispatcher:
    queue = AdmissionQueue(
        {"normal": TierLimits(1, 100, 4.0, early_refusal=early)},
        default_queue_policies(aging_s=30, reference_tokens=8192),
    )
    pool = BackendPool(
        [Backend(url="http://b:1", max_inflight=1)], BackendHealth(), LeastUtilised()
    )
    return Dispatcher(queue, pool, ProxyMetrics(), clock)


def _req(clock: FakeClock, tenant: str = "t") -> QueuedRequest:
    return QueuedRequest(
        tier="normal", tenant=tenant, prompt_tokens=5, expected_output=5, arrival_s=clock()
    )


async def _steady(d: Dispatcher, clock: FakeClock) -> list[asyncio.Future[Lease]]:
    """One slot serving one request a second; three always waiting behind it."""
    waiters = [d.enqueue(_req(clock)) for _ in range(4)]
    for _ in range(12):
        clock.advance(1.0)
        running = next(w for w in waiters if w.done() and not w.result().released)
        waiters.append(d.enqueue(_req(clock)))
        running.result().release()
    assert d.queue.depth("normal") == 3
    return waiters


@pytest.mark.parametrize("early", [True, False])
async def test_a_request_that_would_wait_past_the_timeout_is_refused_at_once(
    early: bool,
) -> None:
    clock = FakeClock()
    d = _dispatcher(clock, early)
    await _steady(d, clock)
    # Served at 1/s with 3 ahead: 3 s, then 4 s (not past the 4 s timeout) are accepted...
    d.enqueue(_req(clock))
    d.enqueue(_req(clock))
    if not early:  # today's behaviour: it queues (and would time out)
        d.enqueue(_req(clock))
        assert d.queue.depth("normal") == 6
        return
    # ...5 s is refused, with the prediction; another tenant gets its turn sooner: accepted.
    with pytest.raises(EarlyRefusal) as refused:
        d.enqueue(_req(clock))
    assert refused.value.predicted_wait_s == pytest.approx(5.0)
    d.enqueue(_req(clock, tenant="light"))
    assert d.queue.depth("normal") == 6
    assert d.metrics.registry.get_sample_value(
        "tierproxy_early_refusals_total", {"tier": "normal"}
    ) == pytest.approx(1.0)


def test_no_refusal_before_the_rate_is_measured() -> None:
    clock = FakeClock()
    d = _dispatcher(clock, early=True)

    async def burst() -> int:
        for _ in range(50):
            d.enqueue(_req(clock))
        return d.queue.depth("normal")

    assert asyncio.run(burst()) == 49  # nothing served yet: nothing to predict from


def test_refused_early_is_a_429_with_the_predicted_wait() -> None:
    err = refused_early("normal", 7.2, 4.0)
    assert err.status == 429 and err.headers() == {"Retry-After": "8"}
    assert outcome_of(err) == Outcome.REFUSED_EARLY


# -- the room's metrics ------------------------------------------------------------------------


async def test_each_change_of_room_is_a_metric(clock: FakeClock) -> None:
    metrics = ProxyMetrics()
    pool = BackendPool([Backend(url="http://e:1", name="e")], BackendHealth(), LeastUtilised())
    (state,) = pool.all()
    async with aiohttp.ClientSession() as session:
        monitor = BackendMonitor(pool, session, metrics, lambda: None, clock)
        for _ in range(8):
            pool.acquire(state, 1.0)
        for _ in range(2):  # two looks at vLLM running the whole room: it grows
            state.load = ScrapedLoad(waiting=0, running=8, kv_usage=0.1, at=clock())
            monitor.tick_rooms()
            clock.advance(0.5)
        clock.advance(1.0)
        for _ in range(2):  # two looks at vLLM queueing: the room drops to what it runs
            state.load = ScrapedLoad(waiting=10, running=4, kv_usage=0.1, at=clock())
            monitor.tick_rooms()
            clock.advance(0.5)
        # The proxy has 8 in flight there, vLLM's scheduler holds 5: 3 are in its API server.
        state.load = ScrapedLoad(waiting=1, running=4, kv_usage=0.1, at=clock())
        monitor.export_gauges()

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"backend": "e", **labels})

    assert sample("tierproxy_backend_room_changes_total", reason="grow") == 1
    assert sample("tierproxy_backend_room_changes_total", reason="queued") == 1
    assert sample("tierproxy_backend_room") == 6  # vLLM runs 4, plus the allowance of 2
    assert sample("tierproxy_backend_transit") == 3


def test_bench_proxy_config_carries_the_scenario_slo_and_adaptive_room() -> None:
    from proxy.bench.proxy_config import proxy_config, validate
    from proxy.bench.scenario import load_scenario

    scenario = load_scenario("seed-mixed")
    data = proxy_config(scenario, ["http://127.0.0.1:8100"], max_inflight=None, early_refusal=True)
    assert data["backends"] == [{"url": "http://127.0.0.1:8100"}]
    config = validate(data).config
    high = config.tiers["high"]
    assert high.slo is not None and high.slo.ttft_s == scenario.slo["high"].ttft_s
    assert high.early_refusal and config.backends[0].adaptive_room
