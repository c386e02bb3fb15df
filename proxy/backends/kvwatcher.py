"""The KV-event subscribers of every backend, kept in step with the pool and the config: one
``KvSubscriber`` (``proxy.backends.kvsubscriber``) per backend that publishes KV events, started,
moved and stopped as backends and ``kv_cache`` settings change."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

import aiohttp
import zmq
import zmq.asyncio

from proxy.backends.backend import BackendState
from proxy.backends.kvindex import KvIndex
from proxy.backends.kvsubscriber import KvSubscriber
from proxy.backends.pool import BackendPool
from proxy.config.kv_cache import KvCache
from proxy.tasks import OwnedTask
from proxy.telemetry.kvmetrics import KvIndexMetrics

log = logging.getLogger("tierproxy.kvevents")
_SYNC_PAUSE_S = 1.0  # between two looks of the supervisor at the pool


class KvEventWatcher:
    """Starts a subscriber for each backend of the pool while ``kv_cache`` is on, stops the
    ones of backends that left, and hangs each backend's index on its state."""

    def __init__(
        self,
        pool: BackendPool,
        settings: Callable[[], KvCache | None],
        session: aiohttp.ClientSession,
        metrics: KvIndexMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.settings = settings  # None: off under the current config
        self.session = session
        self.metrics = metrics
        self.clock = clock
        self._ctx: zmq.asyncio.Context | None = None  # made with the first subscriber
        self._task = OwnedTask("tierproxy-kv-events")
        self._subs: dict[str, tuple[KvSubscriber, OwnedTask]] = {}
        self._block_size: int | None = None

    def start(self) -> None:
        self._task.start(self._run)

    async def stop(self) -> None:
        await self._task.stop()
        await self._stop(set(self._subs))
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _run(self) -> None:
        while True:
            await self.sync()
            await asyncio.sleep(_SYNC_PAUSE_S)

    async def sync(self) -> None:
        settings = self.settings()
        if settings is None or settings.block_size != self._block_size:
            await self._stop(set(self._subs))  # off, or every index is of another block size
            self._block_size = settings.block_size if settings is not None else None
        urls = {s.cfg.url for s in self.pool.all()} if settings is not None else set()
        await self._stop(set(self._subs) - urls)
        for url in urls - set(self._subs):
            assert settings is not None
            self._subs[url] = self._start(url, settings)
        for sub, task in self._subs.values():
            if task.done:  # never meant to end (its errors are caught): start it again
                log.error("backend %s: KV-event subscriber ended; started again", sub.label)
                sub.metrics.errors.labels(sub.label).inc()
                task.start(sub.run)
        for state in self.pool.all():
            self._attach(state, settings)

    def _start(self, url: str, settings: KvCache) -> tuple[KvSubscriber, OwnedTask]:
        index = KvIndex(settings.block_size, settings.max_blocks, self.clock, settings.resync_s)
        current = functools.partial(self._current, settings)
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sub = KvSubscriber(url, index, current, self.pool, self.session, self.metrics, self._ctx)
        task = OwnedTask(f"tierproxy-kv-events {url}")
        task.start(sub.run)
        return sub, task

    def _current(self, fallback: KvCache) -> KvCache:
        return self.settings() or fallback

    def _attach(self, state: BackendState, settings: KvCache | None) -> None:
        entry = self._subs.get(state.cfg.url)
        if entry is None:
            state.kv_index = None
            return
        sub = entry[0]
        index = state.kv_index = sub.index
        if settings is not None:  # a reload may change these in place
            index.max_blocks, index.resync_s = settings.max_blocks, settings.resync_s
        label = state.label
        self.metrics.blocks.labels(label).set(len(index))
        trust = index.trust()
        self.metrics.warm.labels(label).set(1 if trust else 0)
        self.metrics.trust.labels(label).set(int(trust))
        self.metrics.evicted.labels(label).inc(index.stats.evicted - sub.reported_evicted)
        sub.reported_evicted = index.stats.evicted

    async def _stop(self, urls: set[str]) -> None:
        for url in urls:
            sub, task = self._subs.pop(url)
            await task.stop()
            state = self.pool.states.get(url)
            if state is not None and state.kv_index is sub.index:
                state.kv_index = None
