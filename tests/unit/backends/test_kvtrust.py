"""How far a backend's index is trusted (``proxy.backends.kvindex.Trust``), and how soon after a
proxy joins an engine that has been up a while: partial (it lacks only what was stored before
it joined, never over-predicts) as soon as the connection is up, exact after an
AllBlocksCleared or from the engine's first batch, cold without a connection. The feed with an
injected clock; the subscriber against an in-process publisher (its batches numbered far past
any replay buffer) with the trust gauge read as a scrape would."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from proxy.backends.backend import BackendState
from proxy.backends.kvevents import EventFeed, decode_batch
from proxy.backends.kvindex import KvIndex, Trust
from proxy.backends.kvwatcher import KvEventWatcher
from proxy.backends.pool import BackendPool
from proxy.bench.inproc import until
from proxy.config.backends import Backend, BackendHealth
from proxy.config.kv_cache import KvCache
from proxy.ops.process import free_port
from proxy.policies.backends import LeastUtilised
from proxy.policies.blockhash import chain_hashes
from proxy.telemetry.metrics import ProxyMetrics
from tests.helpers.clock import FakeClock
from tests.unit.backends.test_kvsubscriber import Publisher, stored

B = 4
CLEARED = {"type": "AllBlocksCleared"}


def _batch(*events: object) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), 0])


def _feed(clock: FakeClock, resync_s: float = 0.0) -> tuple[KvIndex, EventFeed, BackendState]:
    index = KvIndex(B, 1000, clock, resync_s)
    state = BackendState(cfg=Backend(url="http://b"), kv_index=index)
    return index, EventFeed(index, clock), state


def test_a_proxy_joining_a_long_running_engine_trusts_its_index_at_once_as_partial() -> None:
    index, feed, state = _feed(FakeClock())
    assert index.trust() == Trust.COLD and state.cached_blocks((1,)) is None
    feed.reconnected()
    assert index.trust() == Trust.COLD  # opening: nothing known yet
    feed.connected()
    assert index.trust() == Trust.PARTIAL and state.cached_blocks((1,)) == 0
    feed.apply(50_000, decode_batch(_batch(stored([7], list(range(4))))))
    assert index.trust() == Trust.PARTIAL  # batch 50,000: what came before is unknown
    assert state.cached_blocks(chain_hashes(list(range(5)), B)) == 1


def test_a_first_batch_heard_before_the_connection_event_also_makes_it_partial() -> None:
    index, feed, _ = _feed(FakeClock())
    feed.reconnected()
    feed.apply(9_999_999, decode_batch(_batch()))
    assert index.trust() == Trust.PARTIAL
    feed.connected()  # later: changes nothing
    assert index.trust() == Trust.PARTIAL


def test_all_blocks_cleared_makes_a_partial_index_exact_and_a_gap_partial_again() -> None:
    index, feed, _ = _feed(FakeClock())
    feed.reconnected()
    feed.connected()
    feed.apply(700, decode_batch(_batch(stored([1], list(range(4))))))
    feed.apply(701, decode_batch(_batch(CLEARED, stored([2], list(range(10, 14))))))
    assert index.trust() == Trust.EXACT and len(index) == 1
    feed.apply(703, decode_batch(_batch()))  # 702 lost: dropped, hears on from here
    assert index.trust() == Trust.PARTIAL and len(index) == 0
    feed.apply(0, decode_batch(_batch()))  # a new engine's first batch
    assert index.trust() == Trust.EXACT


def test_a_cold_index_stays_cold_on_all_blocks_cleared() -> None:
    index = KvIndex(B, 10, FakeClock())
    index.all_cleared()
    assert index.trust() == Trust.COLD


def test_resync_s_still_holds_a_partial_index_back_where_an_operator_sets_it() -> None:
    clock = FakeClock()
    index, feed, state = _feed(clock, resync_s=10.0)
    feed.reconnected()
    feed.connected()
    assert index.trust() == Trust.COLD and state.cached_blocks((1,)) is None
    clock.advance(10.0)
    assert index.trust() == Trust.PARTIAL
    feed.apply(5, decode_batch(_batch(CLEARED)))
    assert index.trust() == Trust.EXACT  # exact needs no wait


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def test_the_trust_gauge_of_a_proxy_started_beside_a_long_running_engine(
    ctx: zmq.asyncio.Context,
) -> None:
    port = free_port()
    backend = Backend(url="http://127.0.0.1:9", kv_events=f"tcp://127.0.0.1:{port}")
    pool = BackendPool([backend], BackendHealth(), LeastUtilised())
    state = pool.all()[0]
    publisher = Publisher(ctx, port)
    publisher.seq = 123_456  # up a while: far past any replay buffer
    metrics = ProxyMetrics()
    labels = {"backend": state.label}

    def trust() -> float | None:
        return metrics.registry.get_sample_value("tierproxy_kv_index_trust", labels)

    async with aiohttp.ClientSession() as session:
        watcher = KvEventWatcher(pool, lambda: KvCache(block_size=B), session, metrics.kv)
        try:
            await watcher.sync()
            await publisher.subscribed()
            # Connected, no batch yet (an idle engine): partial, used by the chooser.
            await until(lambda: state.cached_blocks((1,)) == 0, 10, "partial on connection")
            await watcher.sync()  # the supervisor's look sets the gauges
            assert trust() == 1.0
            await publisher.send(stored([5], list(range(4))))
            await until(lambda: state.cached_blocks(chain_hashes(list(range(5)), B)) == 1, 10)
            await publisher.send(CLEARED)
            await until(lambda: state.kv_index is not None and state.kv_index.trust() == 2, 10)
            await watcher.sync()
            assert trust() == 2.0
            labels_warm = metrics.registry.get_sample_value("tierproxy_kv_index_warm", labels)
            assert labels_warm == 1.0
        finally:
            await watcher.stop()
            publisher.close()
