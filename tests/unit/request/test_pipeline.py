"""The request pipeline against in-process fake vLLM backends (proxy.bench.fake_vllm), with
the fake clock driving the queue deadlines, the ejections and the tenant-limit waits (the rig
of tests/helpers/rig.py)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import make_config, until
from proxy.policies.cost import weighted_tokens
from proxy.relay.budget import held_estimate
from proxy.tools.engine import free_port
from tests.helpers.clock import FakeClock
from tests.helpers.rig import BODY, Rig, error_of, rig, served_rig, tenant, tenants

# -- tenant limits -------------------------------------------------------------------------


async def test_on_limit_queue_waits_for_the_bucket_then_passes(clock: FakeClock) -> None:
    backend = FakeVLLM()
    async with served_rig(
        clock, backend, tenants=tenants(requests_per_minute=1, on_limit="queue")
    ) as r:
        assert (await r.chat()).status == 200
        second = await r.chat()
        assert second.status == 200
        assert r.sleep.waits == [pytest.approx(60.0)]  # one token a minute
        assert len(backend.received) == 2
        labels = {"tenant": "tenant-normal", "limit": "requests_per_minute"}
        assert r.metric("tierproxy_rate_limited_total", labels) == 1
        assert r.state.limits.concurrent("tenant-normal") == 0


async def test_a_wait_past_the_queue_timeout_is_refused_at_once(clock: FakeClock) -> None:
    backend = FakeVLLM()
    async with served_rig(
        clock,
        backend,
        tiers={"normal": {"queue_timeout_s": 30}},
        tenants=tenants(requests_per_minute=1, on_limit="queue"),
    ) as r:
        assert (await r.chat()).status == 200
        refused = await r.chat()
        assert refused.status == 429 and refused.headers["Retry-After"] == "60"
        assert (await error_of(refused))["code"] == "rate_limit_exceeded"
        assert r.sleep.waits == []  # 60 s of wait would pass the 30 s queue timeout
        outcome = {"tier": "normal", "outcome": "rate_limited"}
        assert r.metric("tierproxy_requests_total", outcome) == 1


async def test_concurrency_wait_gives_up_at_the_queue_timeout(clock: FakeClock) -> None:
    backend = FakeVLLM()
    async with served_rig(
        clock,
        backend,
        tiers={"normal": {"queue_timeout_s": 5}},
        tenants=tenants(max_concurrent=1, on_limit="queue"),
    ) as r:
        backend.gate.clear()
        first = asyncio.create_task(r.chat())
        await until(lambda: backend.active == 1, 5, "the first request at the backend")
        started = clock()
        refused = await r.chat()
        assert refused.status == 429 and refused.headers["Retry-After"] == "1"
        assert (await error_of(refused))["code"] == "rate_limit_exceeded"
        # Polled every 0.25 s (a slot frees at no known time) until the next wait of 1 s
        # would end past the 5 s deadline: still waiting at 4.0 s, refused at 4.25 s.
        assert set(r.sleep.waits) == {0.25} and len(r.sleep.waits) == 17
        assert clock() - started == pytest.approx(4.25)
        backend.gate.set()
        assert (await first).status == 200
        assert r.state.limits.concurrent("tenant-normal") == 0


# -- queue and dispatch ----------------------------------------------------------------------


async def test_queue_timeout_is_a_503_with_retry_after(clock: FakeClock) -> None:
    backend = FakeVLLM()
    async with served_rig(
        clock, backend, backend={"max_inflight": 1}, tiers={"normal": {"queue_timeout_s": 10}}
    ) as r:
        backend.gate.clear()
        running = asyncio.create_task(r.chat("high"))
        await until(lambda: backend.active == 1, 5, "the first request at the backend")
        waiting = asyncio.create_task(r.chat())
        await until(lambda: len(r.state.queue) == 1, 5, "the second request queued")
        await r.advance(10.0)
        timed_out = await waiting
        assert timed_out.status == 503 and timed_out.headers["Retry-After"] == "1"
        error = await error_of(timed_out)
        assert error["code"] == "queue_timeout" and "10.0s" in error["message"]
        assert len(r.state.queue) == 0
        backend.gate.set()
        assert (await running).status == 200


# -- retries -----------------------------------------------------------------------------------


async def test_every_backend_overloaded_ends_in_503_after_max_attempts(clock: FakeClock) -> None:
    a, b = FakeVLLM(status=503), FakeVLLM(status=503)
    async with served_rig(clock, a, b) as r:
        resp = await r.chat()
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        assert (await error_of(resp))["code"] == "backend_overloaded"
        assert len(a.received) + len(b.received) == 3  # backend_health.max_attempts
        assert r.metric("tierproxy_retries_total") == 2
        errors = sum(
            r.metric("tierproxy_backend_errors_total", {"backend": url, "kind": "503"})
            for url in r.urls
        )
        assert errors == 3
        states = r.state.pool.all()
        # Two failures in a row eject a backend; one may be one request's bad luck.
        for state, fake in zip(states, (a, b), strict=True):
            ejected = state.ejected_until > clock()
            assert ejected == (len(fake.received) >= 2), (state, len(fake.received))
        assert any(s.ejected_until > clock() for s in states)
        outcome = {"tier": "normal", "outcome": "unavailable"}
        assert r.metric("tierproxy_requests_total", outcome) == 1
        assert all(s.inflight == 0 for s in states) and len(r.state.queue) == 0


async def test_a_refusing_backend_is_ejected_and_the_retry_waits_it_out(clock: FakeClock) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    config = make_config([{"url": dead}], backend_health={"max_attempts": 2})
    async with rig(config, clock) as r:
        pending = asyncio.create_task(r.chat())
        await until(lambda: len(r.state.queue) == 1, 5, "the retry queued behind the ejection")
        (backend,) = r.state.pool.all()
        assert backend.ejected_until == pytest.approx(clock() + 1.0)  # at once: eject_base_s
        await r.advance(1.0)
        resp = await pending
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        error = await error_of(resp)
        assert error["code"] == "backend_unavailable" and "connect" in error["message"]
        assert r.metric("tierproxy_backend_errors_total", {"backend": dead, "kind": "connect"}) == 2
        assert backend.inflight == 0 and len(r.state.queue) == 0


# -- reloads -----------------------------------------------------------------------------------


def without_low(config: dict[str, Any]) -> dict[str, Any]:
    tiers = {k: v for k, v in config["tiers"].items() if k != "low"}
    kept = [t for t in config["tenants"] if t["tier"] != "low"]
    return {**config, "tiers": tiers, "tenants": kept}


def moved_to_normal(config: dict[str, Any]) -> dict[str, Any]:
    """The low tier removed, tenant-low moved to the normal tier (priority 5, not 10)."""
    tiers = {k: v for k, v in config["tiers"].items() if k != "low"}
    moved = [{**t, "tier": "normal"} if t["tier"] == "low" else t for t in config["tenants"]]
    return {**config, "tiers": tiers, "tenants": moved}


async def low_queued_behind_high(
    r: Rig, backend: FakeVLLM
) -> tuple[asyncio.Task[aiohttp.ClientResponse], asyncio.Task[aiohttp.ClientResponse]]:
    """A high request held at the backend (room 1), and a low one queued behind it."""
    backend.gate.clear()
    running = asyncio.create_task(r.chat("high"))
    await until(lambda: backend.active == 1, 5, "the first request at the backend")
    queued = asyncio.create_task(r.chat("low"))
    await until(lambda: r.state.queue.depth("low") == 1, 5, "the low request queued")
    return running, queued


async def test_a_queued_request_whose_tenant_is_removed_gets_401_at_the_reload(
    clock: FakeClock,
) -> None:
    # Once served under the config it was admitted with (red team F3 of rt4: keys revoked by a
    # reload). Now answered at the reload itself, as a new request with its key would be.
    backend = FakeVLLM()
    async with served_rig(clock, backend, backend={"max_inflight": 1}, tenants=tenants()) as r:
        running, queued = await low_queued_behind_high(r, backend)
        r.reload(without_low(r.config))
        resp = await queued  # the backend still holds the first: not waited for
        assert resp.status == 401 and (await error_of(resp))["code"] == "invalid_api_key"
        assert r.state.queue.depth("low") == 0 and backend.active == 1
        backend.gate.set()
        assert (await running).status == 200
        assert len(backend.received) == 1
        r.reload(without_low(r.config))
        assert "low" not in r.state.queue.tiers()  # gone once drained


async def test_a_queued_request_whose_tier_is_removed_moves_with_its_tenant(
    clock: FakeClock,
) -> None:
    backend = FakeVLLM()
    async with served_rig(clock, backend, backend={"max_inflight": 1}, tenants=tenants()) as r:
        running, queued = await low_queued_behind_high(r, backend)
        r.reload(moved_to_normal(r.config))
        assert r.state.queue.depth("low") == 0 and r.state.queue.depth("normal") == 1
        backend.gate.set()
        assert (await running).status == 200
        assert (await queued).status == 200
        # Served at its tenant's new tier: the low tier's priority (10) is nobody's now.
        assert backend.received[-1].body["priority"] == 5
        r.reload(moved_to_normal(r.config))
        assert "low" not in r.state.queue.tiers()


async def test_a_retry_after_its_tenant_is_removed_gets_401(clock: FakeClock) -> None:
    backend = FakeVLLM(status=503)
    async with served_rig(clock, backend, tenants=tenants()) as r:
        backend.gate.clear()
        pending = asyncio.create_task(r.chat("low"))
        await until(lambda: backend.active == 1, 5, "the request at the backend")
        r.reload(without_low(r.config))  # running: left to its backend
        backend.gate.set()  # ... which answers 503: the retry would queue it again
        resp = await pending
        assert resp.status == 401 and (await error_of(resp))["code"] == "invalid_api_key"
        assert len(r.state.queue) == 0 and r.state.pool.all()[0].inflight == 0


async def test_a_limit_wait_whose_tenant_is_removed_gets_401(clock: FakeClock) -> None:
    backend = FakeVLLM()
    low = [tenant("tenant-low", "low", "key-low", requests_per_minute=1, on_limit="queue")]
    async with served_rig(clock, backend, tenants=tenants()[:2] + low) as r:
        assert (await r.chat("low")).status == 200
        r.sleep.gate.clear()
        pending = asyncio.create_task(r.chat("low"))
        await until(lambda: len(r.sleep.waits) == 1, 5, "the tenant-limit wait")
        r.reload(without_low(r.config))
        r.sleep.gate.set()
        resp = await pending
        assert resp.status == 401 and (await error_of(resp))["code"] == "invalid_api_key"
        assert len(backend.received) == 1


# -- a client that leaves ------------------------------------------------------------------


async def _leave(r: Rig, task: asyncio.Task[aiohttp.ClientResponse]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    gone = {"tier": "normal", "outcome": "client_gone"}
    await until(lambda: r.metric("tierproxy_requests_total", gone) == 1, 5, "client_gone")


async def test_a_client_leaving_during_the_limit_wait_leaves_nothing(clock: FakeClock) -> None:
    backend = FakeVLLM()
    async with served_rig(
        clock, backend, tenants=tenants(requests_per_minute=1, on_limit="queue")
    ) as r:
        assert (await r.chat()).status == 200
        r.sleep.gate.clear()
        leaving = asyncio.create_task(r.chat())
        await until(lambda: len(r.sleep.waits) == 1, 5, "the tenant-limit wait")
        await _leave(r, leaving)
        assert len(backend.received) == 1 and len(r.state.queue) == 0
        assert r.state.limits.concurrent("tenant-normal") == 0


async def test_a_client_leaving_the_queue_leaves_nothing(clock: FakeClock) -> None:
    backend = FakeVLLM()
    async with served_rig(
        clock, backend, backend={"max_inflight": 1}, tenants=tenants(max_concurrent=5)
    ) as r:
        backend.gate.clear()
        running = asyncio.create_task(r.chat("high"))
        await until(lambda: backend.active == 1, 5, "the first request at the backend")
        leaving = asyncio.create_task(r.chat())
        await until(lambda: len(r.state.queue) == 1, 5, "the second request queued")
        assert r.state.limits.concurrent("tenant-normal") == 1
        await _leave(r, leaving)
        assert len(r.state.queue) == 0 and r.state.limits.concurrent("tenant-normal") == 0
        backend.gate.set()
        assert (await running).status == 200
        assert len(backend.received) == 1  # the one that left never reached it
        (state,) = r.state.pool.all()
        assert state.inflight == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_leaving_while_forwarded_closes_the_upstream(
    clock: FakeClock, stream: bool
) -> None:
    backend = FakeVLLM()
    async with served_rig(clock, backend, tenants=tenants(max_concurrent=5)) as r:
        backend.gate.clear()
        leaving = asyncio.create_task(r.chat(stream=stream))
        await until(lambda: backend.active == 1, 5, "the request at the backend")
        await _leave(r, leaving)
        await until(lambda: backend.hung_up == 1, 5, "the backend to see the hang-up")
        (state,) = r.state.pool.all()
        assert state.inflight == 0 and len(r.state.queue) == 0
        assert r.state.limits.concurrent("tenant-normal") == 0


# -- accounting ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_fairness_counter_ends_at_the_real_usage(clock: FakeClock, stream: bool) -> None:
    backend = FakeVLLM(usage=(7, 3))
    async with served_rig(clock, backend, tenants=tenants(weight=2)) as r:
        resp = await r.chat(stream=stream, max_tokens=100)
        assert resp.status == 200
        if stream:  # the proxy asked for the usage chunk; the client did not get it
            assert b'"usage"' not in await resp.read()
        real = weighted_tokens(7, 3) / 2  # weighted tokens over the tenant's weight
        estimate = r.vtc_counter("tenant-normal")
        assert estimate == pytest.approx(real)
        assert real < weighted_tokens(1, 100) / 2  # the estimate was far above it
        for kind, count in (("prompt", 7), ("completion", 3)):
            labels = {"tier": "normal", "kind": kind}
            assert r.metric("tierproxy_tokens_total", labels) == count


async def test_an_answer_without_usage_gives_the_estimate_back(clock: FakeClock) -> None:
    backend = FakeVLLM(status=400)
    async with served_rig(clock, backend) as r:
        resp = await r.chat()
        assert resp.status == 400  # the backend's own answer, passed on
        assert r.vtc_counter("tenant-normal") == 0.0
        outcome = {"tier": "normal", "outcome": "client_error"}
        assert r.metric("tierproxy_requests_total", outcome) == 1


# -- backend choice ------------------------------------------------------------------------


@pytest.mark.parametrize("chooser", ["least_utilised", "prefix_affinity"])
async def test_the_configured_chooser_steers_by_the_prompt_prefix(
    clock: FakeClock, chooser: str
) -> None:
    """Prompt A is served by the first backend, prompt B (while A holds it) by the second.
    Later, with both idle, least_utilised sends B to the first again; prefix_affinity sends it
    where its prefix is cached."""
    first, second = FakeVLLM(), FakeVLLM()
    prompt_a = [{"role": "user", "content": "document A " * 40}]
    prompt_b = [{"role": "user", "content": "document B " * 40}]
    async with served_rig(
        clock, first, second, backend={"max_inflight": 2}, policies={"backends": chooser}
    ) as r:
        first.gate.clear()
        held = asyncio.create_task(r.chat(messages=prompt_a))
        await until(lambda: first.active == 1, 5, "A held by the first backend")
        assert (await r.chat(messages=prompt_b)).status == 200
        first.gate.set()
        assert (await held).status == 200
        assert (await r.chat(messages=prompt_b)).status == 200

    def served_b(backend: FakeVLLM) -> int:
        return sum(got.body["messages"] == prompt_b for got in backend.received)

    expected = (0, 2) if chooser == "prefix_affinity" else (1, 1)
    assert (served_b(first), served_b(second)) == expected


# -- what the proxy holds ------------------------------------------------------------------


async def test_the_memory_budget_refuses_at_once_and_comes_back(clock: FakeClock) -> None:
    backend = FakeVLLM()
    one_body = held_estimate(len(orjson.dumps(BODY)))
    async with served_rig(clock, backend, limits={"max_held_bytes": one_body + 10}) as r:
        backend.gate.clear()
        held = asyncio.create_task(r.chat())
        await until(lambda: backend.active == 1, 5, "the first request at the backend")
        refused = await r.chat()
        assert refused.status == 503 and refused.headers["Retry-After"] == "1"
        assert (await error_of(refused))["code"] == "proxy_memory_full"
        backend.gate.set()
        assert (await held).status == 200
        assert r.state.budget.held == 0  # every reservation released
        assert (await r.chat()).status == 200


async def test_limit_waiters_count_against_the_tier_queue_cap(clock: FakeClock) -> None:
    backend = FakeVLLM()
    async with served_rig(
        clock,
        backend,
        tiers={"normal": {"max_queue": 1}},
        tenants=tenants(requests_per_minute=1, on_limit="queue"),
    ) as r:
        assert (await r.chat()).status == 200
        r.sleep.gate.clear()  # the next one waits for the bucket, and stays waiting
        waiting = asyncio.create_task(r.chat())
        await until(lambda: len(r.sleep.waits) == 1, 5, "a request waiting for the limit")
        refused = await asyncio.wait_for(r.chat(), 5)  # at once, not after a wait
        assert refused.status == 429
        assert (await error_of(refused))["code"] == "queue_full"
        r.sleep.gate.set()
        assert (await waiting).status == 200
        assert r.state.queue.limit_waiting("normal") == 0
