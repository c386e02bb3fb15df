"""``/admin/status`` and per-tenant usage on the whole app, against an in-process backend, on
a fake clock: what is queued and running, the window's rates, shares and refusals, the usage
counters' bounded labels and the usage log written off the loop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.backends.backend import BackendState
from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import SECRET, auth, make_config, until
from proxy.config.backends import Backend
from proxy.config.loader import parse_config
from proxy.config.tenants import hash_key
from proxy.ops.live.status import backend_state
from proxy.ops.usage import UsageRecord
from proxy.server.app import create_app
from proxy.server.state import STATE, ProxyState
from tests.helpers.clock import FakeClock

ADMIN = {"Authorization": "Bearer admin-secret"}
Client = TestClient[web.Request, web.Application]


def _config(url: str, log: Path) -> dict[str, Any]:
    tenants: list[dict[str, Any]] = [
        {"name": "tenant-high", "tier": "high", "keys": [{"sha256": hash_key("key-high")}]},
        {
            "name": "tenant-low",
            "tier": "low",
            "keys": [{"sha256": hash_key("key-low")}],
            "requests_per_minute": 1,
            "weight": 3,
        },
    ]
    return make_config(
        [{"url": url, "name": "b0", "max_inflight": 1}],
        tenants=tenants,
        admin_keys=[{"sha256": hash_key("admin-secret")}],
        usage_log={"path": str(log)},
    )


def _chat() -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def _status(client: Client, query: str = "") -> Any:
    async with asyncio.timeout(10), client.get("/admin/status" + query, headers=ADMIN) as r:
        assert r.status == 200
        return await r.json()


async def _post(client: Client, tier: str) -> int:
    async with (
        asyncio.timeout(10),
        client.post("/v1/chat/completions", json=_chat(), headers=auth(tier)) as r,
    ):
        await r.read()
        return r.status


async def test_status_shows_queues_tenants_backends_and_the_window(
    clock: FakeClock, tmp_path: Path
) -> None:
    backend = FakeVLLM(usage=(7, 3))
    log = tmp_path / "usage.jsonl"
    async with backend.serve() as url:
        app = create_app(
            parse_config(yaml.safe_dump(_config(url, log))), secret=SECRET, clock=clock
        )
        state: ProxyState = app[STATE]
        async with TestClient(TestServer(app)) as client:
            await until(lambda: bool(state.pool.known_models()), 10, "the backend's models")
            backend.gate.clear()
            running = asyncio.create_task(_post(client, "high"))
            queued = asyncio.create_task(_post(client, "low"))
            await until(lambda: backend.active == 1 and state.queue.depth("low") == 1, 10)
            clock.advance(2)  # the one running 2 s at the backend, the other 2 s queued
            status = await _status(client)
            high, normal, low = status["tiers"]
            assert (high["name"], high["depth"], high["running"]) == ("high", 0, 1)
            assert (low["name"], low["depth"], low["running"], low["max_queue"]) == (
                "low",
                1,
                0,
                500,
            )
            rows = {t["name"]: t for t in status["tenants"]}
            assert (rows["tenant-high"]["running"], rows["tenant-high"]["queued"]) == (1, 0)
            assert (rows["tenant-low"]["running"], rows["tenant-low"]["queued"]) == (0, 1)
            (b0,) = status["backends"]
            assert (b0["name"], b0["state"], b0["inflight"], b0["room"]) == ("b0", "healthy", 1, 0)
            assert (b0["max_inflight"], b0["capacity"]) == (1, 1.0)

            assert await _post(client, "low") == 429  # tenant-low: 1 request a minute
            backend.gate.set()
            assert await asyncio.wait_for(running, 10) == 200
            assert await asyncio.wait_for(queued, 10) == 200
            clock.advance(8)  # 10 s since the app started: the window so far
            status = await _status(client)
            assert status["window_s"] == 10
            rows = {t["name"]: t for t in status["tenants"]}
            assert rows["tenant-high"]["tokens_per_s"] == 1.0  # 7 + 3 tokens over 10 s
            assert rows["tenant-high"]["share"] == 1.0 and rows["tenant-high"]["fair_share"] == 1.0
            assert rows["tenant-low"]["limits_hit"] == {"requests_per_minute": 1}
            high, normal, low = status["tiers"]
            assert low["refused"] == {"rate_limited": 1} and low["finished"] == 2
            assert high["refused"] == {} and high["finished"] == 1
            assert high["wait_p99_s"] is not None and normal["wait_p99_s"] is None
            assert low["wait_p99_s"] >= 1.0  # the low request waited 2 s (bucket 1..2.5 s)
            assert "tenant-normal" not in rows  # idle tenants are left out
            assert len((await _status(client, "?tenants=1"))["tenants"]) == 1

            async with client.get("/metrics", headers=ADMIN) as r:
                metrics = await r.text()
            assert (
                'tierproxy_usage_tokens_total{kind="completion",model="tiny",outcome="ok",'
                'tenant="tenant-low",tier="low"} 3.0'
            ) in metrics
            assert (
                'tierproxy_usage_requests_total{model="tiny",outcome="rate_limited",'
                'tenant="tenant-low",tier="low"} 1.0'
            ) in metrics
            assert (
                'tierproxy_usage_queue_seconds_total{model="tiny",outcome="ok",'
                'tenant="tenant-low",tier="low"} 2.0'
            ) in metrics
        # The app stopped: every finished request's line is on disk.
    records = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    by_outcome = sorted((r["tenant"], r["outcome"]) for r in records)
    assert by_outcome == [
        ("tenant-high", "ok"),
        ("tenant-low", "ok"),
        ("tenant-low", "rate_limited"),
    ]
    first = next(r for r in records if r["tenant"] == "tenant-high")
    assert first["backend"] == "b0" and first["model"] == "tiny" and first["status"] == 200
    assert (first["prompt_tokens"], first["completion_tokens"]) == (7, 3)
    assert first["engine_s"] == 2.0 and first["queue_s"] == 0.0
    low_ok = next(r for r in records if r["tenant"] == "tenant-low" and r["outcome"] == "ok")
    assert low_ok["queue_s"] == 2.0 and low_ok["engine_s"] == 0.0


async def test_status_needs_an_admin_key(clock: FakeClock, tmp_path: Path) -> None:
    async with FakeVLLM().serve() as url:
        config = _config(url, tmp_path / "u.jsonl")
        app = create_app(parse_config(yaml.safe_dump(config)), secret=SECRET, clock=clock)
        async with TestClient(TestServer(app)) as client:
            for headers in ({}, auth("high")):
                async with client.get("/admin/status", headers=headers) as r:
                    assert r.status == 401
            async with client.get("/admin/status?tenants=0", headers=ADMIN) as r:
                assert r.status == 400 and "tenants" in (await r.json())["error"]["message"]


async def test_usage_labels_stay_within_the_config(clock: FakeClock, tmp_path: Path) -> None:
    async with FakeVLLM().serve() as url:
        config = _config(url, tmp_path / "u.jsonl")
        state = create_app(parse_config(yaml.safe_dump(config)), secret=SECRET, clock=clock)[STATE]
    meter = state.usage
    state.pool.states[url].models = frozenset({"tiny"})
    record = UsageRecord(
        ts=0, request_id="r", tenant="gone", tier="retired", model="made-up", backend=None,
        status=200, outcome="ok", prompt_tokens=0, completion_tokens=0, queue_s=0, engine_s=0,
        duration_s=0,
    )  # fmt: skip
    assert meter.bounded(record) == ("other", "other", "other", "ok")
    known = UsageRecord(
        **{**record.__dict__, "tenant": "tenant-low", "tier": "low", "model": "tiny"}
    )
    assert meter.bounded(known) == ("tenant-low", "low", "tiny", "ok")
    unparsed = UsageRecord(**{**record.__dict__, "tenant": "tenant-low", "model": None})
    assert meter.bounded(unparsed)[2] == "-"


def test_backend_states(clock: FakeClock) -> None:
    now, ramp_s = clock(), 5.0
    b = BackendState(cfg=Backend(url="http://b:1"))
    assert backend_state(b, now, ramp_s) == "healthy"
    b.reinstated_at = now - 1
    assert backend_state(b, now, ramp_s) == "ramping"
    b.reinstated_at = now - 6
    assert backend_state(b, now, ramp_s) == "healthy"
    b.ejected_until = now + 1
    assert backend_state(b, now, ramp_s) == "ejected"
    b.healthy = False
    assert backend_state(b, now, ramp_s) == "down"
    b.draining = True
    assert backend_state(b, now, ramp_s) == "draining"
