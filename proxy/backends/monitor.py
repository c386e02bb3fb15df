"""Active watching of backends: /health, /metrics (load) and /v1/models, each on its interval.

Each backend is probed by a task of its own, on its own schedule (``metrics_interval_s``), so
that a slow backend (an overloaded API server answering /metrics in seconds) delays only its
own probes, never the load and health of the others. A supervisor task, owned by the app,
starts and stops those tasks as backends come and go, and ticks the room controllers. Every
probe has its own timeout and its answer is read up to a cap (``proxy.backends.probes``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

import aiohttp
import orjson

from proxy.backends.backend import BackendState
from proxy.backends.clock_offset import OffsetWarnings, date_offset
from proxy.backends.pool import BackendPool
from proxy.backends.probes import (
    HEALTH_CAP_BYTES,
    MODELS_CAP_BYTES,
    ProbeAnswer,
    ProbeFailed,
    probe_get,
)
from proxy.tasks import OwnedTask
from proxy.telemetry.metrics import ProxyMetrics
from proxy.telemetry.prometheus import parse_vllm_load

log = logging.getLogger("tierproxy.monitor")

_MIN_PAUSE_S = 0.05  # between two probe rounds of one backend, however long the last took


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
        self._probers: dict[str, OwnedTask] = {}  # per backend URL, owned by the supervisor
        self._last_health: dict[str, float] = {}
        self._last_models: dict[str, float] = {}
        self._oversize_logged: set[str] = set()  # one warning per backend until a good scrape

    def start(self) -> None:
        self._task.start(self._run)

    async def stop(self) -> None:
        await self._task.stop()
        await self._stop_probers(set(self._probers))

    async def _run(self) -> None:
        while True:
            await self._sync_probers()
            self.tick_rooms()
            self.export_gauges()
            self.on_change()
            await asyncio.sleep(max(_MIN_PAUSE_S, self.pool.health.metrics_interval_s))

    async def _sync_probers(self) -> None:
        """One probing task per backend of the pool: started for new ones, stopped for gone."""
        urls = {state.cfg.url for state in self.pool.all()}
        await self._stop_probers(set(self._probers) - urls)
        for url in urls - set(self._probers):
            task = self._probers[url] = OwnedTask(f"tierproxy-probe {url}")
            task.start(functools.partial(self._probe_loop, url))

    async def _stop_probers(self, urls: set[str]) -> None:
        for url in urls:
            await self._probers.pop(url).stop()

    async def _probe_loop(self, url: str) -> None:
        # Runs until the supervisor stops it (the backend left the pool); never ends alone, so
        # a backend removed and added back between two supervisor looks is still probed.
        while True:
            started = self.clock()
            state = self.pool.states.get(url)
            if state is not None:
                await self._probe_safely(state)
                self.on_change()  # its health or load may free room: the dispatcher looks again
            interval = self.pool.health.metrics_interval_s
            await asyncio.sleep(max(_MIN_PAUSE_S, interval - (self.clock() - started)))

    async def probe_all(self) -> None:
        """One probe round of every backend at once, then a room tick (tests, start-up)."""
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
            ok = await self._get(state, "health", HEALTH_CAP_BYTES) is not None
            was = state.available(now)
            self.pool.probe_result(state, ok, self.clock())
            if was != state.available(self.clock()):
                log.warning("backend %s is %s", state.label, "back" if ok else "down")
            if not ok:
                return
        models_due = now - self._last_models.get(state.cfg.url, -1e9) >= health.models_interval_s
        if models_due and await self._refresh_models(state):
            self._last_models[state.cfg.url] = now
        answer = await self._get(state, "metrics", health.max_metrics_bytes, clock_of=state)
        if answer is None:
            return
        # Cheap enough for the loop at the cap: only the wanted lines are split (prometheus).
        load = parse_vllm_load(answer.body.decode("utf-8", "replace"), self.clock())
        if load is not None:
            state.scraped(load)

    async def _get(
        self, state: BackendState, probe: str, cap: int, *, clock_of: BackendState | None = None
    ) -> ProbeAnswer | None:
        """A 200 answer to ``GET /<probe>`` read within the cap; None (and counted) otherwise."""
        path = "/v1/models" if probe == "models" else f"/{probe}"
        try:
            answer = await probe_get(
                self.session,
                state.cfg.url + path,
                timeout_s=self.pool.health.probe_timeout_s,
                cap=cap,
            )
        except ProbeFailed as exc:
            self._failed(state, probe, exc.reason, cap)
            return None
        if clock_of is not None:
            self._read_clock(clock_of, answer.headers.get("Date"))
        if answer.status != 200:
            self._failed(state, probe, "status", cap)
            return None
        if probe == "metrics":
            self._oversize_logged.discard(state.cfg.url)
        return answer

    def _failed(self, state: BackendState, probe: str, reason: str, cap: int) -> None:
        self.metrics.backend_probe_failures.labels(state.label, probe, reason).inc()
        if reason == "oversize" and state.cfg.url not in self._oversize_logged:
            self._oversize_logged.add(state.cfg.url)
            log.warning(
                "backend %s: its /%s answer passed %d bytes; cut, counted as a failed probe",
                state.label,
                probe,
                cap,
            )

    def _read_clock(self, state: BackendState, date_header: str | None) -> None:
        offset = date_offset(date_header, self.wall())
        if offset is not None:
            state.clock_offset_s = offset
            self.offset_warnings.saw(state.label, offset)

    async def _refresh_models(self, state: BackendState) -> bool:
        answer = await self._get(state, "models", MODELS_CAP_BYTES)
        if answer is None:
            return False
        try:
            data = orjson.loads(answer.body).get("data", [])
            cards = [dict(c) for c in data if isinstance(c, dict) and "id" in c]
        except (orjson.JSONDecodeError, AttributeError, TypeError):
            self._failed(state, "models", "invalid", MODELS_CAP_BYTES)
            return False
        state.models = frozenset(str(c["id"]) for c in cards)
        state.model_cards = tuple(cards)
        # Its LoRA adapters: the cards with a parent (the base model they adapt).
        adapters = frozenset(str(c["id"]) for c in cards if c.get("parent") is not None)
        state.listed_adapters = adapters
        state.adapters.listed(adapters, self.clock())
        return True

    async def models_payload(self) -> list[dict[str, object]]:
        """Model cards of every available backend, one per id (for /v1/models): the cards each
        backend's last models probe saw (``models_interval_s``), never a backend call per
        request."""
        now = self.clock()
        seen: dict[str, dict[str, object]] = {}
        for state in self.pool.all():
            if state.available(now):
                for card in state.model_cards:
                    seen.setdefault(str(card["id"]), card)
        return list(seen.values())
