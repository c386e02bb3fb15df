"""LoRA adapter slots shared by two in-process replicas through a real Redis: over one engine
with ``max_loras`` 2 and more adapters than slots, the distinct adapters in flight there,
counted over both replicas, never exceed 2 (without the shared claims they reach 4); a stopped
replica's claims come back after its lease; with Redis gone each replica counts alone again.

The engine is the replicas' own bookkeeping (what the proxy counts in flight, not vLLM's): a
lease is held for a while, its adapter load taken as done, then released."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.backends.backend import BackendState
from proxy.backends.pool import BackendPool
from proxy.bench.inproc import until
from proxy.bench.redis_server import RedisServer
from proxy.config.backends import Backend, BackendHealth
from proxy.config.shared_state import SharedState
from proxy.policies.backends import LeastUtilised
from proxy.policies.types import QueuedRequest, TierLimits
from proxy.replicas.adapter_claims import SharedAdapterSlots
from proxy.replicas.client import SharedStore
from proxy.replicas.scripts import ADAPTER_CLAIM
from proxy.scheduling.build import default_queue_policies
from proxy.scheduling.dispatch import Dispatcher, Lease
from proxy.scheduling.queue import AdmissionQueue
from proxy.telemetry.metrics import ProxyMetrics
from tests.helpers.replicas import LIVE_REDIS
from tests.helpers.shared_store import warm
from tests.helpers.timing import polls_until

URL = "http://engine:1"
ADAPTERS = {f"lora-{c}": "tiny" for c in "abcdef"}


@dataclass
class Replica:
    """One proxy process's dispatcher and pool in front of the shared engine."""

    dispatcher: Dispatcher
    claims: SharedAdapterSlots
    claim_calls: list[int] = field(default_factory=lambda: [0])

    @property
    def state(self) -> BackendState:
        return self.dispatcher.pool.all()[0]

    def running(self) -> set[str]:
        return self.state.adapters.running()

    async def send(self, adapter: str) -> Lease:
        req = QueuedRequest(
            tier="t", tenant=adapter, prompt_tokens=5, expected_output=5, arrival_s=time.monotonic(),
            model=adapter,
        )  # fmt: skip
        lease = await self.dispatcher.enqueue(req)
        if (plan := lease.adapter_plan) is not None:  # what the loader does: the load succeeded
            lease.adapter_plan = None
            if plan.unload is not None:
                lease.backend.adapters.unload_done(plan.unload)
            lease.backend.adapters.load_done(plan.load, ok=True)
        return lease


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[Callable[..., Any]]:
    made: list[Replica] = []

    async def make(shared: bool = True, **cfg: Any) -> tuple[Replica, Replica]:
        for name in ("a", "b"):
            settings = {"probe_interval_s": 0.1, **cfg}
            store = SharedStore(
                SharedState(url=redis_server.url, **{**LIVE_REDIS, **settings}), CollectorRegistry()
            )
            await warm(store)
            queue = AdmissionQueue(
                {"t": TierLimits(1, 1000, 30.0)},
                default_queue_policies(aging_s=30, reference_tokens=8192),
            )
            backend = Backend(url=URL, max_inflight=64, max_loras=2, load_adapters=True)
            pool = BackendPool([backend], BackendHealth(), LeastUtilised())
            pool.adapters = ADAPTERS
            dispatcher = Dispatcher(queue, pool, ProxyMetrics())
            claims = SharedAdapterSlots(store, pool, replica=name, kick=dispatcher.kick)
            replica = Replica(dispatcher, claims)
            store.run = _counted(store, replica.claim_calls)  # type: ignore[method-assign]
            dispatcher.start()
            if shared:
                claims.start()
            made.append(replica)
        return made[-2], made[-1]

    yield make
    for replica in made:
        await replica.dispatcher.stop()
        await replica.claims.stop()
        await replica.claims.store.close()


def _counted(store: SharedStore, calls: list[int]) -> Callable[..., Any]:
    """``store.run``, counting the claim scripts (the round trips the claims cost)."""
    run = store.run

    async def counted(script: Any, *args: Any) -> Any:
        calls[0] += script is ADAPTER_CLAIM
        return await run(script, *args)

    return counted


async def _hammer(a: Replica, b: Replica, requests: int) -> tuple[int, int, int]:
    """Four clients per replica, each sending one adapter after another (the six drawn at
    random), each generation held 10-40 ms, until ``requests`` were served (counted, not timed:
    a busy machine serves fewer a second); the distinct adapters in flight on the engine over
    both replicas sampled every 2 ms. Returns (the most seen, requests served, samples)."""
    rng = random.Random(34)
    served = 0

    def going() -> bool:
        return served < requests

    async def client(replica: Replica) -> None:
        nonlocal served
        while going():
            lease = await replica.send(rng.choice(list(ADAPTERS)))
            await asyncio.sleep(rng.uniform(0.01, 0.04))
            lease.release()
            served += 1

    most = samples = 0

    async def sample() -> None:
        nonlocal most, samples
        while going():
            most = max(most, len(a.running() | b.running()))
            samples += 1
            await asyncio.sleep(0.002)

    # A bound against hanging only: 60 requests take ~0.3 s on a quiet machine.
    async with asyncio.timeout(120):
        await asyncio.gather(sample(), *(client(r) for r in (a, b) for _ in range(4)))
    return most, served, samples


async def test_never_more_distinct_adapters_in_flight_than_max_loras_over_both_replicas(
    replicas: Callable[..., Any],
) -> None:
    a, b = await replicas(lease_ttl_s=3.0)
    most, served, samples = await _hammer(a, b, 400)
    calls = a.claim_calls[0] + b.claim_calls[0]
    print(f"shared: most distinct {most}, served {served}, samples {samples}, claims {calls}")
    assert most <= 2
    assert served >= 400 and samples > 100  # both replicas made progress; the sampler ran
    assert a.running() | b.running() == set()  # every claim's request ended


async def test_without_the_shared_claims_each_replica_counts_alone(
    replicas: Callable[..., Any],
) -> None:
    """The control: the same load, the claims not started (as before issue 34's fix): both
    replicas fill their own two slots, four distinct adapters in flight on the engine."""
    a, b = await replicas(shared=False, lease_ttl_s=3.0)
    most, served, _ = await _hammer(a, b, 150)
    print(f"alone: most distinct {most}, served {served}")
    assert most > 2


async def test_a_stopped_replicas_claims_come_back_after_its_lease(
    replicas: Callable[..., Any],
) -> None:
    a, b = await replicas(lease_ttl_s=1.0)
    # Timed from before a's claims: its lease ends a TTL after its claim or its last heartbeat,
    # never sooner. (From the crash, "over 0.5 s" broke when a stall delayed the crash past a
    # heartbeat due.)
    claimed_before = time.monotonic()
    held = [await a.send(name) for name in ("lora-a", "lora-b")]  # a fills both slots
    await a.claims._loop.stop()  # a "crashes": no heartbeat, nothing given back
    await a.claims._listener.stop()
    waiter = asyncio.ensure_future(b.send("lora-c"))
    # The TTL (1 s): 20 polls of 0.05 s quiet, 60 with the machine's lag.
    await polls_until(waiter.done, 60, "b to get a slot after a's lease")
    assert time.monotonic() - claimed_before > 0.9  # not before the lease (Redis's clock: 1 s)
    assert b.running() == {"lora-c"}
    waiter.result().release()
    for lease in held:
        lease.release()


async def test_idle_claims_go_back_when_another_replica_lacks_a_slot(
    replicas: Callable[..., Any],
) -> None:
    a, b = await replicas(lease_ttl_s=30.0)  # far off: only the messages can free a slot
    for name in ("lora-a", "lora-b"):
        (await a.send(name)).release()
    await until(lambda: a.state.adapters.claimed == {"lora-a", "lora-b"}, 5, "a's claims")
    calls = a.claim_calls[0]
    for _ in range(5):  # a steady stream of claimed adapters pays no round trip
        (await a.send("lora-a")).release()
    assert a.claim_calls[0] == calls
    lease = await asyncio.wait_for(b.send("lora-c"), 10)  # a gives its idle claims back
    assert b.running() == {"lora-c"} and len(a.state.adapters.claimed or ()) <= 1
    lease.release()


async def test_with_redis_gone_each_replica_counts_alone(
    replicas: Callable[..., Any], redis_server: RedisServer
) -> None:
    a, b = await replicas(lease_ttl_s=30.0)
    held = [await a.send(name) for name in ("lora-a", "lora-b")]
    redis_server.kill()
    # b's want finds Redis gone: it counts alone (its own max_loras), as the shared room does.
    lease = await asyncio.wait_for(b.send("lora-c"), 15)
    assert b.state.adapters.claimed is None
    for done in (lease, *held):
        done.release()
