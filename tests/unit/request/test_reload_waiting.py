"""A reload and the requests that wait in the queue (proxy.request.pending), in process on the
fake clock, one backend of room 1 held by a gate: the queued excess past a lowered quota is
answered 429 at the reload and gives its reservation back; a revoked key's queued requests get
401 at once; the kept ones are served. The served twin, on real vLLM:
tests/integration/test_reload_queued_served.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import until
from tests.helpers.clock import FakeClock
from tests.helpers.rig import Rig, error_of, served_rig, tenants
from tests.unit.request.test_quota_pipeline import used, with_wall, worst_case_tokens

Tasks = list[asyncio.Task[aiohttp.ClientResponse]]


def depth_is(r: Rig, n: int) -> Callable[[], bool]:
    return lambda: r.state.queue.depth("normal") == n


async def queue_behind_one(r: Rig, backend: FakeVLLM, clock: FakeClock, n: int) -> Tasks:
    """One request at the backend (held), then ``n`` queued behind it, one clock tick apart
    (queue order is arrival order)."""
    backend.gate.clear()
    tasks = [asyncio.create_task(r.chat())]
    await until(lambda: backend.active == 1, 5, "the first request at the backend")
    for i in range(n):
        clock.advance(0.01)
        tasks.append(asyncio.create_task(r.chat()))
        await until(depth_is(r, i + 1), 5, "queued")
    return tasks


async def test_a_lowered_quota_refuses_the_queued_excess_at_the_reload(clock: FakeClock) -> None:
    backend = FakeVLLM()  # reports 7 + 3 tokens per answer
    quota = {"tokens_per_day": 100_000}
    async with served_rig(
        clock, backend, backend={"max_inflight": 1}, tenants=tenants(quota=quota)
    ) as r:
        wall = with_wall(r, "2026-12-01T12:00:00")
        running, *queued = await queue_behind_one(r, backend, clock, 4)
        each = worst_case_tokens()
        assert used(r, "tokens_per_day", 100_000, wall) == 5 * each
        new_limit = 3 * each + 1  # the running one and the two earliest queued
        lowered = dict(r.config)
        lowered["tenants"] = tenants(quota={"tokens_per_day": new_limit})
        r.reload(lowered)
        # Answered now, while the backend still holds the first: the two latest.
        late = queued[2:]
        await until(lambda: all(t.done() for t in late), 5, "the excess answered")
        assert not any(t.done() for t in [running, *queued[:2]])
        for task in late:
            resp = task.result()
            assert resp.status == 429 and "Retry-After" in resp.headers
            error = await error_of(resp)
            assert error["code"] == "quota_exceeded" and error["type"] == "insufficient_quota"
            assert f"limit {new_limit}" in error["message"]
        await until(lambda: r.state.queue.depth("normal") == 2, 5, "the refused out")
        # Their reservations are back: the counter holds the three that may still run.
        await until(lambda: used(r, "tokens_per_day", new_limit, wall) == 3 * each, 5, "given back")
        backend.gate.set()
        for task in [running, *queued[:2]]:
            assert (await task).status == 200
        assert len(backend.received) == 3
        assert used(r, "tokens_per_day", new_limit, wall) == 3 * 10  # settled to the usage
        # A new request meets the same limit.
        assert (await r.chat()).status == 200


async def test_a_revoked_keys_queued_requests_get_401_at_the_reload(clock: FakeClock) -> None:
    backend = FakeVLLM()
    quota = {"tokens_per_day": 100_000}
    async with served_rig(
        clock, backend, backend={"max_inflight": 1}, tenants=tenants(quota=quota)
    ) as r:
        wall = with_wall(r, "2026-12-01T12:00:00")
        running, *queued = await queue_behind_one(r, backend, clock, 3)
        revoked = dict(r.config)
        revoked["tenants"] = tenants(quota=quota)
        revoked["tenants"][1]["keys"] = [{"sha256": "0" * 64}]
        r.reload(revoked)
        await until(lambda: all(t.done() for t in queued), 5, "the queued answered")
        for task in queued:
            resp = task.result()
            assert resp.status == 401
            assert (await error_of(resp))["code"] == "invalid_api_key"
        assert (await r.chat()).status == 401  # as a new request with the key
        # Only the running one's reservation is left; it is served (running: untouched).
        each = worst_case_tokens()
        await until(lambda: used(r, "tokens_per_day", 100_000, wall) == each, 5, "given back")
        backend.gate.set()
        assert (await running).status == 200
        assert len(backend.received) == 1


async def test_a_request_a_backend_sends_back_after_the_reload_meets_the_new_quota(
    clock: FakeClock,
) -> None:
    """Red team, stop 57: a request at a backend during the reload, sent back unrun (503), was
    queued again under its old reservation and run past the new limit (1,023 tokens, limit
    100). It is decided again as it re-enters the queue."""
    backend = FakeVLLM()
    quota = {"tokens_per_day": 100_000}
    async with served_rig(
        clock, backend, backend={"max_inflight": 1}, tenants=tenants(quota=quota)
    ) as r:
        with_wall(r, "2026-12-01T12:00:00")
        (running,) = await queue_behind_one(r, backend, clock, 0)
        lowered = dict(r.config)
        lowered["tenants"] = tenants(quota={"tokens_per_day": 1})
        r.reload(lowered)
        backend.status = 503  # the backend turns it away unrun
        backend.gate.set()
        resp = await running
        assert resp.status == 429, await resp.text()
        assert (await error_of(resp))["code"] == "quota_exceeded"
        assert len(backend.received) == 1  # never sent again
