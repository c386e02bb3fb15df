"""One ZMQ subscriber per backend to its vLLM's KV events, feeding that backend's prefix-cache
index (``proxy.backends.kvindex``), and the supervisor that starts and stops them as backends
and the config come and go. The supervisor is owned by the app (``proxy.server.app``); each
subscriber by the supervisor.

The endpoint comes from the backend's config (``kv_events``) or from its
``GET /kv_event_sources`` (vLLM's publisher config; a wildcard host is the backend URL's host),
asked again whenever the subscriber has heard nothing for ``kv_cache.idle_timeout_s``. ZMQ
reconnects by itself; the socket's monitor tells when the connection is up, and the (empty)
index is then partial: it hears every batch from there, so it never over-predicts, and is
trusted at once (``proxy.backends.kvindex.Trust``); and when it drops, and the index is then
dropped and cold (a restarting engine's cache starts empty; a dropped connection may have lost
batches) until the connection is up again. The next batch says where the stream stands: the
engine's first (or a replay from it), and the index is exact (``proxy.backends.kvevents``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp
import orjson
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from proxy.backends.kvevents import (
    Applied,
    EventBatch,
    EventFeed,
    Sync,
    decode_batch,
    sequence_number,
)
from proxy.backends.kvindex import KvIndex
from proxy.backends.kvreplay import ReplayUnanswered, replay
from proxy.backends.kvsources import SourcesWarnings, event_endpoints
from proxy.backends.pool import BackendPool
from proxy.backends.probes import ProbeFailed, probe_get
from proxy.backends.throttled_log import Throttled
from proxy.config.kv_cache import KvCache
from proxy.telemetry.kvmetrics import KvIndexMetrics

log = logging.getLogger("tierproxy.kvevents")

_SOURCES_CAP_BYTES = 64 * 1024
_ERROR_PAUSE_S = 1.0  # before a subscriber that failed opens its connection again
# A new connection that hears no batch this long asks the engine's history from its replay
# socket (``_replay_history``): an idle engine sends none. A busy one does at once, and its
# first batch asks the replay only of an engine young enough (``EventFeed.missing_from``): a
# long-running engine asked from batch 0 would send its whole buffer (10,000 batches).
HISTORY_WAIT_S = 1.0
HISTORY_TRIES = 4  # asks of an unanswered history (a busy engine), each wait twice the last


class KvSubscriber:
    """One backend's subscriber: runs until the supervisor stops it."""

    def __init__(
        self,
        url: str,
        index: KvIndex,
        settings: Callable[[], KvCache],
        pool: BackendPool,
        session: aiohttp.ClientSession,
        metrics: KvIndexMetrics,
        ctx: zmq.asyncio.Context,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.url = url
        self.index = index
        self.feed = EventFeed(index, wall)
        self.settings = settings
        self.pool = pool
        self.session = session
        self.metrics = metrics
        self.ctx = ctx
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None  # vLLM's replay socket, where it has one
        self._sources_warnings = SourcesWarnings(log)
        self._log_error = Throttled(log)
        self.reported_evicted = 0  # of index.stats.evicted, already in the metric
        # The last batch the replay at connection time applied: live ones up to it are its
        # duplicates (published while it was read). None: no such replay pending.
        self._replayed_upto: int | None = None
        self._history_tries = 0  # asks of this connection's history left unanswered
        self._history_at: float | None = None  # when a new, silent connection asks history

    @property
    def label(self) -> str:
        state = self.pool.states.get(self.url)
        return state.label if state is not None else self.url

    async def run(self) -> None:
        """Until cancelled: an error here (a bug, a ZMQ failure) is logged and counted, the
        index dropped, and the connection opened again after a pause; never a silent end."""
        while True:
            try:
                await self._run()
            except Exception:
                self._log_error(
                    logging.ERROR, "backend %s: KV-event subscriber failed", self.label, exc=True
                )
                self.metrics.errors.labels(self.label).inc()
                self.metrics.connected.labels(self.label).set(0)
                self.endpoint = None
                self.feed.reconnected()  # cold until the connection is up again
                await asyncio.sleep(_ERROR_PAUSE_S)

    async def _run(self) -> None:
        sub: zmq.asyncio.Socket | None = None
        monitor: zmq.asyncio.Socket | None = None
        try:
            while True:
                endpoint = await self.find_endpoint()
                if endpoint is not None and endpoint != self.endpoint:
                    if sub is not None:
                        sub.disable_monitor()
                        _close(sub, monitor)
                        sub = monitor = None
                    sub, monitor = self._open(endpoint)
                    log.info("backend %s: KV events from %s", self.label, endpoint)
                self.metrics.connected.labels(self.label).set(1 if sub is not None else 0)
                timeout = self.settings().idle_timeout_s
                if sub is None or monitor is None:
                    await asyncio.sleep(timeout)
                else:
                    await self._receive(sub, monitor, timeout)
        finally:
            if sub is not None:
                _close(sub, monitor)

    def _open(self, endpoint: str) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)  # vLLM's own default on its side
        # A larger message drops the connection (cold index) rather than the proxy's memory.
        sub.setsockopt(zmq.MAXMSGSIZE, self.settings().max_batch_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: the endpoint is this backend's alone
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(endpoint)
        self.endpoint = endpoint
        self._replayed_upto = self._history_at = None
        self.feed.reconnected()
        return sub, monitor

    async def find_endpoint(self) -> str | None:
        """The configured endpoint, else the backend's answer (with its replay endpoint); the
        current one when the backend does not answer (ZMQ keeps reconnecting to it)."""
        state = self.pool.states.get(self.url)
        if state is None:
            return self.endpoint
        if state.cfg.kv_events:
            self.replay_endpoint = state.cfg.kv_events_replay
            return state.cfg.kv_events
        try:
            answer = await probe_get(
                self.session,
                self.url + "/kv_event_sources",
                timeout_s=self.pool.health.probe_timeout_s,
                cap=_SOURCES_CAP_BYTES,
            )
            sources = orjson.loads(answer.body) if answer.status == 200 else None
        except (ProbeFailed, orjson.JSONDecodeError):
            return self.endpoint
        refused: list[str] = []
        found = event_endpoints(sources, self.url, refused)
        self._sources_warnings.refused(self.label, refused)
        if found is None:
            self._sources_warnings.missing(self.label)
            return self.endpoint
        endpoint, self.replay_endpoint = found
        return endpoint

    async def _receive(
        self, sub: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket, timeout_s: float
    ) -> None:
        """Apply batches until nothing came for ``timeout_s`` (after a drop with nothing
        since: the socket is to be opened again)."""
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        dropped = False
        loop = asyncio.get_running_loop()
        while True:
            wait = timeout_s
            if self._history_at is not None:
                wait = max(0.0, min(wait, self._history_at - loop.time()))
            ready = dict(await poller.poll(wait * 1000))
            if not ready and self._history_at is not None and loop.time() >= self._history_at:
                self._history_at = None
                await self._replay_history()  # exact now, where the engine's buffer allows
                self._report_trust()
                continue
            if not ready:
                if dropped:  # ZMQ does not reconnect after a message past MAXMSGSIZE
                    self.endpoint = None  # the socket is opened afresh
                return
            if monitor in ready:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_CONNECTED:
                    self.feed.connected()  # partial from here, trusted at once
                    self._history_at = loop.time() + HISTORY_WAIT_S
                    self._history_tries = 0
                    self._report_trust()
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    # What the old connection delivered first, then the drop: never a stale
                    # batch of a stopped engine into the index after it was cleared.
                    while await sub.poll(0):
                        await self.on_message(await sub.recv_multipart())
                    log.info("backend %s: KV-event connection dropped", self.label)
                    self._replayed_upto = self._history_at = None
                    self.feed.reconnected()
                    self._report_trust()
                    dropped = True
                    continue
            if sub in ready:
                dropped = False
                self._history_at = None  # its first batch asks the replay where it may
                await self.on_message(await sub.recv_multipart())

    async def on_message(self, frames: list[bytes]) -> None:
        """One message: a batch applied (after a replay of what it says was missed), or, when
        anything about it fails, the index dropped (partial from the next batch) and the
        stream goes on."""
        if len(frames) < 3:
            return
        seq = sequence_number(frames[-2])
        if self._replayed_upto is not None and seq is not None:
            if 0 < seq <= self._replayed_upto:
                return  # published while the replay was read: applied from it
            self._replayed_upto = None
        try:
            if seq is None:
                raise ValueError(f"a sequence-number frame of {len(frames[-2])} bytes")
            batch = decode_batch(frames[-1])
            start = self.feed.missing_from(seq)
            if start is not None and self.replay_endpoint is not None:
                await self._replay(start, seq)
            await self._apply(seq, batch)
        except Exception as exc:
            self._log_error(
                logging.WARNING,
                "backend %s: KV-event batch %s not applied (%s: %s): index dropped",
                self.label,
                seq,
                type(exc).__name__,
                str(exc)[:200],
            )
            if seq is not None:
                self.feed.last_seq = seq
            self.index.lost_sync()
            self.metrics.errors.labels(self.label).inc()
            self.metrics.gaps.labels(self.label).inc()

    async def _apply(self, seq: int, batch: EventBatch) -> None:
        applied = Applied(self.feed.check(seq))
        for _ in self.feed.steps(applied, batch):
            await asyncio.sleep(0)  # a big batch lets the event loop run between slices
        self._count(applied)

    async def _replay_history(self) -> None:
        """A new connection heard nothing (``HISTORY_WAIT_S``): the engine's batches from its
        first, where its replay buffer holds them all, applied: exact, with what it stored
        before this proxy joined (an idle engine sends no batch that would ask it); none at all,
        exact too (``EventFeed.history_empty``). Else partial: it only lacks older blocks."""
        if self.replay_endpoint is None:
            return
        timeout = self.pool.health.probe_timeout_s
        max_bytes = self.settings().max_batch_bytes
        try:
            history = await replay(self.ctx, self.replay_endpoint, 0, None, timeout, max_bytes)
        except ReplayUnanswered as exc:
            self._history_tries += 1
            if again := self._history_tries < HISTORY_TRIES:  # unless a live batch comes first
                wait = HISTORY_WAIT_S * 2**self._history_tries
                self._history_at = asyncio.get_running_loop().time() + wait
            then = "asked again" if again else "the index stays partial"
            log.info("backend %s: KV-event history not replayed (%s); %s", self.label, exc, then)
            return
        if history is None:
            return
        if not history:
            self.feed.history_empty()
            return
        try:
            for seq, batch in history:
                await self._apply(seq, batch)
        except Exception as exc:  # as a live batch that fails: dropped, partial from here
            msg = "backend %s: KV-event history not applied (%s): index dropped"
            self._log_error(logging.WARNING, msg, self.label, type(exc).__name__)
            self.feed.last_seq = None
            self.index.lost_sync()
            return
        self._replayed_upto = history[-1][0]
        self.metrics.replayed.labels(self.label).inc(len(history))

    async def _replay(self, start: int, until: int) -> None:
        """Batches ``start`` .. ``until - 1`` from vLLM's replay socket, applied in order when
        it still holds them all (else the gap drops the index, as without one)."""
        assert self.replay_endpoint is not None
        timeout = self.pool.health.probe_timeout_s
        max_bytes = self.settings().max_batch_bytes
        try:
            missed = await replay(self.ctx, self.replay_endpoint, start, until, timeout, max_bytes)
        except ReplayUnanswered:
            missed = None  # the gap drops the index: a live batch does not wait
        if missed is None:
            log.info("backend %s: KV events %d-%d not replayed", self.label, start, until - 1)
            return
        for seq, batch in missed:
            await self._apply(seq, batch)
        self.metrics.replayed.labels(self.label).inc(len(missed))

    def _report_trust(self) -> None:
        """The trust gauges as they change (the supervisor also sets them each second)."""
        trust = self.index.trust()
        self.metrics.trust.labels(self.label).set(int(trust))
        self.metrics.warm.labels(self.label).set(1 if trust else 0)

    def _count(self, applied: Applied) -> None:
        self._report_trust()
        label = self.label
        if applied.sync == Sync.GAP:
            self.metrics.gaps.labels(label).inc()
        elif applied.sync == Sync.RESTART:
            log.info("backend %s: engine restarted (its KV events numbered again)", label)
            self.metrics.restarts.labels(label).inc()
        if applied.refused:
            self.metrics.refused.labels(label).inc(applied.refused)
            self._log_error(
                logging.WARNING,
                "backend %s: %d KV events not of vLLM's shapes skipped",
                label,
                applied.refused,
            )
        for kind, n in applied.counts.items():
            self.metrics.events.labels(label, kind).inc(n)
        if self.feed.lag_s is not None:
            self.metrics.lag.labels(label).set(self.feed.lag_s)


def _close(sub: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket | None) -> None:
    if monitor is not None:
        monitor.close(linger=0)
    sub.close(linger=0)
