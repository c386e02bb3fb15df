"""The backend monitor against in-process fake backends: probe answers are read up to a cap
(finding #12: one broken backend's 100 MB /metrics stalled the whole proxy) and each backend is
probed on its own schedule (finding #23: one slow /metrics made the others' load stale)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from proxy.backends.monitor import BackendMonitor
from proxy.backends.pool import BackendPool
from proxy.bench.inproc import serve_app, until
from proxy.config.backends import Backend, BackendHealth
from proxy.policies.backends import LeastUtilised
from proxy.telemetry.metrics import ProxyMetrics
from tests.helpers.clock import FakeClock

LOAD = 'vllm:num_requests_running{engine="0"} 3\nvllm:num_requests_waiting{engine="0"} 1\n'
CARD = {"id": "tiny", "object": "model", "owned_by": "vllm"}


class FakeEngine:
    """vLLM's probe routes; ``metrics_pad`` bytes of other series before the load, and a gate
    that /metrics waits at while closed (an overloaded API server)."""

    def __init__(self, metrics_pad: int = 0) -> None:
        self.metrics_pad = metrics_pad
        self.open = asyncio.Event()
        self.open.set()
        self.hits = {"/health": 0, "/metrics": 0, "/v1/models": 0}

    async def _health(self, request: web.Request) -> web.Response:
        self.hits["/health"] += 1
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        self.hits["/v1/models"] += 1
        return web.json_response({"object": "list", "data": [CARD]})

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.hits["/metrics"] += 1
        await self.open.wait()
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        line = b'vllm:histogram_bucket{engine="0",le="0.5"} 1\n'
        with contextlib.suppress(ConnectionResetError):
            for _ in range(self.metrics_pad // 65536):
                await resp.write(line * (65536 // len(line)))
            await resp.write(LOAD.encode())
        return resp

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        async with serve_app(app, handler_cancellation=True) as url:
            yield url


def monitor_of(
    urls: list[str], session: aiohttp.ClientSession, clock: FakeClock, **health: float
) -> tuple[BackendMonitor, BackendPool, ProxyMetrics]:
    backends = [Backend(url=url) for url in urls]
    pool = BackendPool(backends, BackendHealth(**health), LeastUtilised())
    metrics = ProxyMetrics()
    return BackendMonitor(pool, session, metrics, lambda: None, clock), pool, metrics


async def test_a_huge_metrics_answer_is_a_failed_scrape_cut_at_the_cap(clock: FakeClock) -> None:
    engine = FakeEngine(metrics_pad=64 * 1024 * 1024)  # 64 MiB before the load lines
    async with engine.serve() as url, aiohttp.ClientSession() as session:
        # The fake serves 64 MiB from this event loop: on a busy machine that outlasts the
        # default probe timeout, and /v1/models, probed beside it, would time out too. The cap
        # is what this test is about, not time.
        monitor, pool, metrics = monitor_of(
            [url], session, clock, max_metrics_bytes=1 << 20, probe_timeout_s=60.0
        )
        await monitor.probe_all()
        (state,) = pool.all()
        assert state.load is None  # not read past the cap, so never parsed
        assert state.available(clock()) and state.models == frozenset({"tiny"})
        labels = {"backend": url, "probe": "metrics", "reason": "oversize"}
        sample = metrics.registry.get_sample_value
        assert sample("tierproxy_backend_probe_failures_total", labels) == 1
        engine.metrics_pad = 512 * 1024  # under the cap: read and parsed
        await monitor.probe_all()
        assert state.load is not None and (state.load.running, state.load.waiting) == (3, 1)
        assert sample("tierproxy_backend_probe_failures_total", labels) == 1


async def test_a_slow_backend_delays_only_its_own_probes(clock: FakeClock) -> None:
    slow, healthy = FakeEngine(), FakeEngine()
    slow.open.clear()  # its /metrics hangs until the probe timeout (5 s)
    async with slow.serve() as slow_url, healthy.serve() as url, aiohttp.ClientSession() as session:
        monitor, pool, _ = monitor_of(
            [slow_url, url], session, clock, metrics_interval_s=0.05, probe_timeout_s=5.0
        )
        monitor.start()
        try:
            # In lockstep, the healthy backend was scraped once per 5 s (five in 20 s): here,
            # every 50 ms (0.25 s). 10 s tells the two apart however busy the machine is.
            await until(lambda: healthy.hits["/metrics"] >= 5, 10.0, "healthy scrapes")
            assert slow.hits["/metrics"] == 1
            state = pool.states[url]
            assert state.load is not None and state.load.running == 3
        finally:
            await monitor.stop()
            slow.open.set()


async def test_v1_models_answers_from_the_cards_the_probes_saw(clock: FakeClock) -> None:
    engines = [FakeEngine(), FakeEngine()]
    async with engines[0].serve() as a, engines[1].serve() as b, aiohttp.ClientSession() as session:
        monitor, _, _ = monitor_of([a, b], session, clock)
        await monitor.probe_all()
        seen = [e.hits["/v1/models"] for e in engines]
        for _ in range(50):
            assert await monitor.models_payload() == [CARD]
        assert [e.hits["/v1/models"] for e in engines] == seen == [1, 1]
