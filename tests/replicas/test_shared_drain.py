"""An admin drain reaches every replica: with ``serve --workers 2`` (one port, two processes,
the kernel spreading connections) a drain taken by one worker stops new work to the backend
in both; and the sync itself, on a real Redis, over two pools."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from proxy.backends.pool import BackendPool
from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.redis_server import RedisServer
from proxy.config.backends import Backend, BackendHealth
from proxy.config.shared_state import SharedState
from proxy.config.tenants import hash_key
from proxy.ops.process import free_port, http_ok
from proxy.policies.backends import LeastUtilised
from proxy.replicas.client import SharedStore
from proxy.replicas.drain import SharedDrain
from tests.helpers.replicas import LIVE_REDIS, owner, post, replica_config

ADMIN_KEY = "admin-key-for-drain"


def _pool(urls: list[str]) -> BackendPool:
    return BackendPool(
        [Backend(url=u, max_inflight=4) for u in urls], BackendHealth(), LeastUtilised()
    )


async def test_a_drain_published_by_one_replica_is_applied_and_taken_back_by_another(
    redis_server: RedisServer,
) -> None:
    urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    cfg = SharedState(url=redis_server.url, **LIVE_REDIS)
    stores = [SharedStore(cfg), SharedStore(cfg)]
    pools = [_pool(urls), _pool(urls)]
    a, b = (SharedDrain(s, p) for s, p in zip(stores, pools, strict=True))
    try:
        assert pools[0].drain(urls[0]) is not None  # the admin endpoint drains locally first
        await a.publish(urls[0], True)
        assert await b.sync()
        assert [s.draining for s in pools[1].all()] == [True, False]
        # A drain this replica applied alone (Redis down then) is not undone by the sync.
        pools[1].drain(urls[1])
        assert not await b.sync()
        assert [s.draining for s in pools[1].all()] == [True, True]
        pools[0].drain(urls[0], False)
        await a.publish(urls[0], False)
        assert await b.sync()
        assert [s.draining for s in pools[1].all()] == [False, True]
        assert not await a.sync()  # the publisher's own pool already agrees
    finally:
        for store in stores:
            await store.close()


async def test_with_two_workers_a_drained_backend_gets_no_new_work(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    kept, drained = FakeVLLM(model="null", usage=(4, 4)), FakeVLLM(model="null", usage=(4, 4))
    async with kept.serve() as kept_url, drained.serve() as drained_url:
        config = replica_config(kept_url, redis_server.url)
        # The drained one first: on a tie (both idle) a worker that missed the drain picks it.
        config["backends"] = [
            {"url": drained_url, "max_inflight": 64},
            {"url": kept_url, "max_inflight": 64},
        ]
        config["admin_keys"] = [{"sha256": hash_key(ADMIN_KEY)}]
        port = free_port()
        proc = owner(config, tmp_path, port).start()
        base = f"http://127.0.0.1:{port}"
        try:
            await asyncio.to_thread(
                proc.wait_until, lambda: http_ok(f"{base}/healthz", 2.0), 60, "/healthz"
            )
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"{base}/admin/backends/drain",
                    json={"url": drained_url, "drain": True},
                    headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                ) as resp,
            ):
                assert resp.status == 200
                answer = await resp.json()
                assert answer["draining"] is True and answer["shared"] is True
            # No wait: the answer came once every worker had synced.
            before = drained.served
            for _ in range(40):  # a connection each: the kernel spreads them over the workers
                async with aiohttp.ClientSession() as fresh:
                    assert (await post(fresh, base)).status == 200
            assert drained.served == before
            assert kept.served >= 40
        finally:
            proc.stop()
