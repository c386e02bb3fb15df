"""Active watching of backends: /health, /metrics (load) and /v1/models, each on its interval.

One task, owned by the app; every probe has its own timeout, and a slow backend never delays
the probes of the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp
import orjson

from proxy.scheduling.backend import BackendState
from proxy.scheduling.clock_offset import OffsetWarnings, date_offset
from proxy.scheduling.pool import BackendPool
from proxy.tasks import OwnedTask
from proxy.telemetry.metrics import ProxyMetrics
from proxy.telemetry.prometheus import parse_vllm_load

log = logging.getLogger("tierproxy.monitor")


class BackendMonitor:
    def __init__(
        self,
        pool: BackendPool,
        session: aiohttp.ClientSession,
        metrics: ProxyMetrics,
        on_change: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.pool = pool
        self.session = session
        self.metrics = metrics
        self.on_change = on_change
        self.clock = clock
        self.wall = wall  # epoch seconds, to read a backend's Date against
        self.offset_warnings = OffsetWarnings(clock)
        self._task = OwnedTask("tierproxy-backend-monitor")
        self._last_health: dict[str, float] = {}
        self._last_models: dict[str, float] = {}

    def start(self) -> None:
        self._task.start(self._run)

    async def stop(self) -> None:
        await self._task.stop()

    async def _run(self) -> None:
        while True:
            started = self.clock()
            await self.probe_all()
            self.on_change()
            interval = self.pool.health.metrics_interval_s
            await asyncio.sleep(max(0.05, interval - (self.clock() - started)))

    async def probe_all(self) -> None:
        states = self.pool.all()
        await asyncio.gather(*(self._probe_safely(s) for s in states))
        self.tick_rooms()
        self.export_gauges()

    def tick_rooms(self) -> None:
        """Let each backend's room controller look at what this pass saw (docs/slo.md)."""
        now = self.clock()
        for state in self.pool.all():
            change = self.pool.tick_room(state, now)
            if change is not None:
                self.metrics.slo.backend_room_changes.labels(state.label, change.reason).inc()
                log.info(
                    "backend %s room %g -> %g (%s)",
                    state.label,
                    change.old,
                    change.new,
                    change.reason,
                )

    async def _probe_safely(self, state: BackendState) -> None:
        # One backend's odd answer must never stop the watching of all of them.
        try:
            await self._probe(state)
        except Exception:
            log.exception("probing backend %s failed", state.label)

    def export_gauges(self) -> None:
        now = self.clock()
        for state in self.pool.all():
            label = state.label
            self.metrics.backend_inflight.labels(label).set(state.inflight)
            self.metrics.backend_available.labels(label).set(1 if state.available(now) else 0)
            age = now - state.load.at if state.load is not None else float("inf")
            self.metrics.backend_metrics_age.labels(label).set(age)
            self.metrics.slo.backend_room.labels(label).set(state.max_room)
            if state.clock_offset_s is not None:
                self.metrics.backend_clock_offset.labels(label).set(state.clock_offset_s)
            load = state.fresh_load(now, self.pool.health.stale_after_s)
            if load is not None:
                self.metrics.slo.backend_transit.labels(label).set(state.in_transit(load))

    async def _probe(self, state: BackendState) -> None:
        health = self.pool.health
        now = self.clock()
        if now - self._last_health.get(state.cfg.url, -1e9) >= health.health_interval_s:
            self._last_health[state.cfg.url] = now
            ok = await self._get_ok(state, "/health")
            was = state.available(now)
            self.pool.probe_result(state, ok, self.clock())
            if was != state.available(self.clock()):
                log.warning("backend %s is %s", state.label, "back" if ok else "down")
            if not ok:
                return
        models_due = now - self._last_models.get(state.cfg.url, -1e9) >= health.models_interval_s
        if models_due and await self._refresh_models(state):
            self._last_models[state.cfg.url] = now
        text = await self._get_text(state, "/metrics", clock_of=state)
        if text is not None:
            load = parse_vllm_load(text, self.clock())
            if load is not None:
                state.load = load

    async def _get_ok(self, state: BackendState, path: str) -> bool:
        try:
            async with asyncio.timeout(self.pool.health.probe_timeout_s):
                async with self.session.get(state.cfg.url + path) as resp:
                    await resp.read()
                    return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def _get_text(
        self, state: BackendState, path: str, *, clock_of: BackendState | None = None
    ) -> str | None:
        try:
            async with asyncio.timeout(self.pool.health.probe_timeout_s):
                async with self.session.get(state.cfg.url + path) as resp:
                    if clock_of is not None:
                        self._read_clock(clock_of, resp.headers.get("Date"))
                    if resp.status != 200:
                        return None
                    return await resp.text()
        except (TimeoutError, aiohttp.ClientError, OSError, UnicodeDecodeError):
            return None

    def _read_clock(self, state: BackendState, date_header: str | None) -> None:
        offset = date_offset(date_header, self.wall())
        if offset is not None:
            state.clock_offset_s = offset
            self.offset_warnings.saw(state.label, offset)

    async def _refresh_models(self, state: BackendState) -> bool:
        text = await self._get_text(state, "/v1/models")
        if text is None:
            return False
        try:
            data = orjson.loads(text).get("data", [])
            state.models = frozenset(str(m["id"]) for m in data if isinstance(m, dict))
        except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
            return False
        return True

    async def models_payload(self) -> list[dict[str, object]]:
        """Model cards of every available backend, one per id (for /v1/models)."""
        now = self.clock()
        seen: dict[str, dict[str, object]] = {}
        for state in self.pool.all():
            if not state.available(now):
                continue
            text = await self._get_text(state, "/v1/models")
            if text is None:
                continue
            try:
                data = orjson.loads(text).get("data", [])
            except (orjson.JSONDecodeError, AttributeError):
                continue
            for card in data:
                if isinstance(card, dict) and "id" in card:
                    seen.setdefault(str(card["id"]), card)
        return list(seen.values())
