"""The KV-event subscriber and its supervisor against an in-process ZMQ publisher that sends
what vLLM's does (frames topic, 8-byte sequence, msgpack batch): an engine seen from its first
batch is warm; its publisher going away drops the index (cold); a new publisher on the same
endpoint (an engine restart) starts it again from sequence 0; the endpoint from
``/kv_event_sources`` with the backend's host; kv_cache off stops the subscribers. The backend
is kept down (unavailable) only in health terms; the index does not care."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from proxy.backends import kvsubscriber
from proxy.backends.kvindex import Trust
from proxy.backends.kvsubscriber import KvSubscriber
from proxy.backends.kvwatcher import KvEventWatcher
from proxy.backends.pool import BackendPool
from proxy.bench.inproc import serve_app, until
from proxy.config.backends import Backend, BackendHealth
from proxy.config.kv_cache import KvCache
from proxy.ops.process import free_port
from proxy.policies.backends import LeastUtilised
from proxy.policies.blockhash import chain_hashes
from proxy.telemetry.metrics import ProxyMetrics

B = 4


class Publisher:
    """vLLM's ZmqEventPublisher's wire format, bound like vLLM binds it. An XPUB (a PUB that
    hears subscriptions), so that a test publishes once the subscriber listens: what a PUB
    sends before that is lost (ZMQ's slow joiner)."""

    def __init__(self, ctx: zmq.asyncio.Context, port: int) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.seq = 0
        self.buffer = []
        self.asked: list[int] = []  # the replay's start of each request to the replay socket
        self.unanswered = 0  # the next asks of the replay socket left without an answer

    async def subscribed(self) -> None:
        async with asyncio.timeout(10):
            assert (await self.sock.recv())[:1] == b"\x01"

    async def send(self, *events: dict[str, Any], lost: bool = False) -> None:
        """One batch; ``lost``: buffered for replay but never delivered live (dropped at the
        high-water mark, or sent while the subscriber was away)."""
        payload = msgspec.msgpack.encode([1.0, list(events), 0])
        self.buffer.append((self.seq, payload))
        if not lost:
            await self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    buffer: list[tuple[int, bytes]]

    async def serve_replay(self, router: zmq.asyncio.Socket) -> None:
        """vLLM's ZmqEventPublisher._service_replay: every buffered batch from the asked start
        on, then the end marker."""
        while True:
            client, _, start = await router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.asked.append(first)
            if self.unanswered > 0:  # an engine too busy to answer in time
                self.unanswered -= 1
                continue
            for seq, payload in self.buffer:
                if seq >= first:
                    await router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payload])
            await router.send_multipart(
                [client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
            )

    def close(self) -> None:
        self.sock.close(linger=0)


def stored(hashes: list[int], ids: list[int]) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": ids,
        "block_size": B,
        "medium": "GPU",
        "group_idx": 0,
    }


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def _watch(
    pool: BackendPool, settings: list[KvCache | None], session: aiohttp.ClientSession
) -> KvEventWatcher:
    watcher = KvEventWatcher(pool, lambda: settings[0], session, ProxyMetrics().kv)
    await watcher.sync()
    return watcher


async def test_first_batch_warm_publisher_gone_cold_restart_warm(
    ctx: zmq.asyncio.Context,
) -> None:
    port = free_port()
    backend = Backend(url="http://127.0.0.1:9", kv_events=f"tcp://127.0.0.1:{port}")
    pool = BackendPool([backend], BackendHealth(), LeastUtilised())
    state = pool.all()[0]
    settings: list[KvCache | None] = [KvCache(block_size=B, resync_s=3600)]
    publisher = Publisher(ctx, port)
    async with aiohttp.ClientSession() as session:
        watcher = await _watch(pool, settings, session)
        try:
            assert state.kv_index is not None and state.cached_blocks((1,)) is None  # cold
            prompt = chain_hashes(list(range(9)), B)
            await publisher.subscribed()
            await publisher.send(stored([1, 2], list(range(8))))  # the engine's first batch
            await until(lambda: state.cached_blocks(prompt) == 2, 10, "the first batch")
            index = state.kv_index
            # The publisher goes away (the engine stops): the index is dropped, cold.
            publisher.close()
            await until(lambda: not index.warm() and len(index) == 0, 10, "dropped")
            # A new engine on the same endpoint: its batches begin at 0 again; warm.
            publisher = Publisher(ctx, port)
            await publisher.subscribed()
            await publisher.send(stored([7], list(range(100, 104))))
            restarted = chain_hashes(list(range(100, 105)), B)
            await until(lambda: state.cached_blocks(restarted) == 1, 10, "the new engine")
            assert state.cached_blocks(prompt) == 0
            # kv_cache turned off by a reload: the subscriber stops, the index goes.
            settings[0] = None
            await watcher.sync()
            assert state.kv_index is None and state.cached_blocks(prompt) is None
        finally:
            await watcher.stop()
            publisher.close()


async def test_the_endpoint_comes_from_kv_event_sources(ctx: zmq.asyncio.Context) -> None:
    port = free_port()

    async def sources(request: web.Request) -> web.Response:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
        return web.json_response({"0": config})

    app = web.Application()
    app.router.add_get("/kv_event_sources", sources)
    async with serve_app(app) as url, aiohttp.ClientSession() as session:
        pool = BackendPool([Backend(url=url)], BackendHealth(), LeastUtilised())
        watcher = await _watch(pool, [KvCache(block_size=B)], session)
        publisher = Publisher(ctx, port)
        state = pool.all()[0]
        try:
            await publisher.subscribed()
            await publisher.send(stored([1], list(range(4))))
            prompt = chain_hashes(list(range(5)), B)
            await until(lambda: state.cached_blocks(prompt) == 1, 10, "a batch")
        finally:
            await watcher.stop()
            publisher.close()


@asynccontextmanager
async def _replaying_engine(
    ctx: zmq.asyncio.Context, health: BackendHealth | None = None
) -> AsyncIterator[tuple[Backend, BackendPool, Publisher, aiohttp.ClientSession]]:
    """One backend whose publisher has a replay socket (vLLM's ``replay_endpoint``), and a
    session for its watcher."""
    port, replay_port = free_port(), free_port()
    backend = Backend(
        url="http://127.0.0.1:9",
        kv_events=f"tcp://127.0.0.1:{port}",
        kv_events_replay=f"tcp://127.0.0.1:{replay_port}",
    )
    pool = BackendPool([backend], health or BackendHealth(), LeastUtilised())
    publisher = Publisher(ctx, port)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    serving = asyncio.create_task(publisher.serve_replay(router))
    try:
        async with aiohttp.ClientSession() as session:
            yield backend, pool, publisher, session
    finally:
        serving.cancel()
        publisher.close()
        router.close(linger=0)


async def _watch_one(
    pool: BackendPool, kv: KvCache, session: aiohttp.ClientSession, metrics: ProxyMetrics
) -> KvEventWatcher:
    watcher = KvEventWatcher(pool, lambda: kv, session, metrics.kv)
    await watcher.sync()
    return watcher


@pytest.fixture
def no_history(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new connection's history is asked only after an hour of silence: these tests' own
    batches decide every replay (on a busy machine the first may take over a second)."""
    monkeypatch.setattr(kvsubscriber, "HISTORY_WAIT_S", 3600.0)


@pytest.mark.usefixtures("no_history")
async def test_a_gap_is_filled_from_the_replay_socket(ctx: zmq.asyncio.Context) -> None:
    async with _replaying_engine(ctx) as (backend, pool, publisher, session):
        state = pool.all()[0]
        metrics = ProxyMetrics()
        watcher = await _watch_one(pool, KvCache(block_size=B, resync_s=3600), session, metrics)
        try:
            await publisher.subscribed()
            # Batches 0 and 1 never reach the subscriber; 2 does: 0 and 1 come from the replay
            # socket, and the index is complete, warm at once, without a cold window.
            await publisher.send(stored([1], list(range(4))), lost=True)
            await publisher.send(stored([2], list(range(10, 14))), lost=True)
            await publisher.send(stored([3], list(range(20, 24))))
            prompts = [chain_hashes(list(range(first, first + 5)), B) for first in (0, 10, 20)]
            await until(lambda: all(state.cached_blocks(p) == 1 for p in prompts), 10, "0 to 2")
            # A gap the replay buffer no longer covers (its batch 4 is gone): dropped, cold.
            await publisher.send(stored([4], list(range(30, 34))), lost=True)
            publisher.buffer.pop()
            await publisher.send(stored([5], list(range(40, 44))))
            index = state.kv_index
            assert index is not None
            await until(lambda: not index.warm(), 10, "cold after an unreplayable gap")
            assert len(index) == 1  # the batch after the gap only
            labels = {"backend": backend.label}
            assert (
                metrics.registry.get_sample_value(
                    "tierproxy_kv_events_replayed_batches_total", labels
                )
                == 2
            )
            assert metrics.registry.get_sample_value("tierproxy_kv_event_gaps_total", labels) == 1
        finally:
            await watcher.stop()


@pytest.mark.parametrize("history", ["young", "past-its-buffer", "none"])
async def test_a_new_connection_replays_the_engines_history_before_any_batch(
    ctx: zmq.asyncio.Context, history: str
) -> None:
    """A proxy joining an idle engine whose replay buffer holds its every batch (a young
    engine; a proxy restarted beside it) is exact within ``HISTORY_WAIT_S``, with what was
    stored before it joined: it does not wait for the engine's next batch (an idle one, or one
    serving cache hits, sends none). So is one joining an engine that never published a batch
    (its replay holds none: it stored nothing). Where the buffer no longer starts at batch 0,
    the index stays partial (only older blocks missing). The history is asked from batch 0."""
    exact = history != "past-its-buffer"
    async with _replaying_engine(ctx) as (backend, pool, publisher, session):
        state = pool.all()[0]
        before = (0, 10, 20) if history != "none" else ()
        for first in before:  # stored before the proxy joined
            await publisher.send(stored([first + 1], list(range(first, first + 4))), lost=True)
        if history == "past-its-buffer":
            publisher.buffer.pop(0)  # batch 0 is gone
        metrics = ProxyMetrics()
        # No resync window: only the history makes the index exact.
        watcher = await _watch_one(pool, KvCache(block_size=B, resync_s=0), session, metrics)
        try:
            await publisher.subscribed()
            prompts = [chain_hashes(list(range(f, f + 5)), B) for f in before]
            index = state.kv_index
            assert index is not None
            if exact:
                await until(lambda: index.trust() == Trust.EXACT, 10, "exact from history")
                assert [state.cached_blocks(p) for p in prompts] == [1] * len(before)
                labels = {"backend": backend.label}
                replayed = "tierproxy_kv_events_replayed_batches_total"
                assert metrics.registry.get_sample_value(replayed, labels) == (len(before) or None)
                trust = metrics.registry.get_sample_value("tierproxy_kv_index_trust", labels)
                assert trust == Trust.EXACT
            else:
                await until(lambda: publisher.asked == [0], 10, "the history asked")
                await asyncio.sleep(0.1)  # its (refused) answer read: nothing applied
                assert index.trust() == Trust.PARTIAL
                assert [state.cached_blocks(p) for p in prompts] == [0, 0, 0]
            # The next live batch: in order after the history (the engine's first, where it
            # had none); past its buffer, a gap whose replay is refused again (partial still).
            await publisher.send(stored([31], list(range(30, 34))))
            fresh = chain_hashes(list(range(30, 35)), B)
            await until(lambda: state.cached_blocks(fresh) == 1, 10, "the live batch")
            assert index.trust() == (Trust.EXACT if exact else Trust.PARTIAL)
            assert publisher.asked == ([0] if exact else [0, 0])  # in order: nothing asked
        finally:
            await watcher.stop()


async def test_a_history_the_engine_did_not_answer_in_time_is_asked_again(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy engine that lets the first ask of its history time out: the subscriber asks
    again, later, and the index is exact with what was stored before it joined (it stayed
    partial until the engine restarted). A refusal is not asked again (the test above)."""
    monkeypatch.setattr(kvsubscriber, "HISTORY_WAIT_S", 0.05)
    # Each unanswered ask costs the probe timeout; 0.2 s let an answered ask time out too on a
    # loaded machine (make test-all), and a fourth that did left the index partial.
    async with _replaying_engine(ctx, BackendHealth(probe_timeout_s=1.0)) as engine:
        _, pool, publisher, session = engine
        state = pool.all()[0]
        await publisher.send(stored([1], list(range(4))), lost=True)  # before the proxy joined
        publisher.unanswered = 2
        watcher = await _watch_one(pool, KvCache(block_size=B, resync_s=0), session, ProxyMetrics())  # fmt: skip
        try:
            await publisher.subscribed()
            index = state.kv_index
            assert index is not None
            await until(lambda: index.trust() == Trust.EXACT, 10, "exact from the third ask")
            assert len(publisher.asked) >= 3 and set(publisher.asked) == {0}  # the history, again
            assert state.cached_blocks(chain_hashes(list(range(5)), B)) == 1
        finally:
            await watcher.stop()


def _one_backend(port: int, **kw: Any) -> BackendPool:
    backend = Backend(url="http://127.0.0.1:9", kv_events=f"tcp://127.0.0.1:{port}", **kw)
    return BackendPool([backend], BackendHealth(), LeastUtilised())


async def test_a_batch_that_fails_drops_the_index_and_the_subscriber_goes_on(
    ctx: zmq.asyncio.Context,
) -> None:
    """An event of no shape vLLM sends (an unhashable hash) once killed the subscriber
    silently, its index frozen warm; an unexpected error applying a batch drops the index
    (counted) and the next batches are applied."""
    port = free_port()
    pool = _one_backend(port)
    state = pool.all()[0]
    metrics = ProxyMetrics()
    publisher = Publisher(ctx, port)
    async with aiohttp.ClientSession() as session:
        watcher = KvEventWatcher(pool, lambda: KvCache(block_size=B), session, metrics.kv)
        await watcher.sync()
        labels = {"backend": state.label}

        def sample(name: str) -> float | None:
            return metrics.registry.get_sample_value(name, labels)

        try:
            await publisher.subscribed()
            await publisher.send({"type": "BlockRemoved", "block_hashes": [[1]], "medium": "GPU"})
            await publisher.send(stored([1], list(range(4))))
            prompt = chain_hashes(list(range(5)), B)
            await until(lambda: state.cached_blocks(prompt) == 1, 10, "the batch after")
            assert sample("tierproxy_kv_events_refused_total") == 1
            index = state.kv_index
            assert index is not None and index.warm()

            def broken(*args: object) -> None:
                raise RuntimeError("a bug")

            index.store = broken  # type: ignore[method-assign,assignment]
            await publisher.send(stored([2], list(range(10, 14))))
            await until(lambda: sample("tierproxy_kv_event_errors_total") == 1, 10, "counted")
            assert index.trust() == Trust.PARTIAL and len(index) == 0  # dropped; hears on
            del index.store
            await publisher.send(stored([3], list(range(20, 24))))
            later = chain_hashes(list(range(20, 25)), B)
            await until(lambda: len(index) == 1, 10, "the batch after the error")
            assert index.leading(later) == 1
        finally:
            await watcher.stop()
            publisher.close()


async def test_a_subscriber_that_ended_is_started_again(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[int] = []

    async def ends(self: KvSubscriber) -> None:
        runs.append(1)

    monkeypatch.setattr(KvSubscriber, "run", ends)
    pool = _one_backend(free_port())
    async with aiohttp.ClientSession() as session:
        watcher = await _watch(pool, [KvCache(block_size=B)], session)
        try:
            await until(lambda: len(runs) == 1, 10, "the first run")
            await asyncio.sleep(0)  # the task done
            await watcher.sync()
            await until(lambda: len(runs) == 2, 10, "started again")
        finally:
            await watcher.stop()


@pytest.mark.usefixtures("no_history")
async def test_a_jump_in_sequence_numbers_asks_no_replay(ctx: zmq.asyncio.Context) -> None:
    """A backend's sequence numbers jumping by 2**62 once made the proxy build the whole range
    (MemoryError: subscriber dead); an engine up for long, heard first on a new connection, was
    asked for everything from 0. Neither asks a replay now: cold, then in order again."""
    port, replay_port = free_port(), free_port()
    pool = _one_backend(port, kv_events_replay=f"tcp://127.0.0.1:{replay_port}")
    state = pool.all()[0]
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    publisher = Publisher(ctx, port)
    publisher.seq = 50_000  # a long-running engine
    async with aiohttp.ClientSession() as session:
        watcher = await _watch(pool, [KvCache(block_size=B, resync_s=3600)], session)
        try:
            await publisher.subscribed()
            await publisher.send(stored([1], list(range(4))))
            index = state.kv_index
            assert index is not None
            await until(lambda: len(index) == 1, 10, "the first batch heard")
            publisher.seq = 2**62
            await publisher.send(stored([2], list(range(10, 14))))
            await publisher.send(stored([3], list(range(20, 24))))
            await until(lambda: len(index) == 2, 10, "the batches after the jump")
            assert not index.warm()
            assert not await router.poll(200)  # never asked
        finally:
            await watcher.stop()
            publisher.close()
            router.close(linger=0)


async def test_a_message_past_max_batch_bytes_is_never_taken(ctx: zmq.asyncio.Context) -> None:
    port = free_port()
    pool = _one_backend(port)
    state = pool.all()[0]
    publisher = Publisher(ctx, port)
    settings = KvCache(block_size=B, max_batch_bytes=64 * 1024, idle_timeout_s=0.2)
    async with aiohttp.ClientSession() as session:
        watcher = await _watch(pool, [settings], session)
        try:
            await publisher.subscribed()
            big = [stored([i], list(range(4 * i, 4 * i + 4))) for i in range(1, 2000)]
            await publisher.send(*big)  # ~150 KiB: the connection is dropped instead
            index = state.kv_index
            assert index is not None
            async with asyncio.timeout(10):  # until the subscriber is back (ZMQ reconnects)
                while len(index) == 0:
                    await publisher.send(stored([7], list(range(100, 104))))
                    await asyncio.sleep(0.05)
            assert index.leading(chain_hashes(list(range(100, 105)), B)) == 1
            assert index.stats.stored < len(big)  # none of the big batch's blocks
        finally:
            await watcher.stop()
            publisher.close()
