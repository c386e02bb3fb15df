"""The Grafana dashboard on a real Prometheus (Debian's 2.42): it scrapes two proxy replicas
sharing one Redis (as the compose file runs them) and a real vLLM, a little mixed load runs
(three tiers, streams, one its client leaves, a tenant refused at its limit, a backend that answers 503 and is ejected),
then every PromQL expression of configs/grafana/dashboards/tierproxy.json is evaluated as
Grafana evaluates it (a range query, ``$__rate_interval`` as Grafana sizes it): each parses,
returns data, and draws one series per legend (two replicas must not draw a backend twice).

/metrics is scraped both ways configs/prometheus.yml describes: one replica on its admin
listener (no key), the other on its client listener with the admin key as a bearer token."""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.bench.inproc import auth, make_config, running_proxy, serve_app
from proxy.bench.redis_server import RedisServer
from proxy.config.tenants import hash_key
from proxy.ops.process import free_port
from proxy.server.state import ProxyState
from tests.helpers import promserver
from tests.helpers.dashboard import REFUSAL_OUTCOMES, panels
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import CORE

pytestmark = [pytest.mark.integration, pytest.mark.engines(CORE)]
TIMEOUT = aiohttp.ClientTimeout(total=60)
ADMIN_KEY = "admin-key-of-the-dashboard-test"
SCRAPE_S = 1.0
# Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval), with
# $__interval the step (1 s here).
GRAFANA_VARS = {"$__rate_interval": "4s", "$__interval": "1s", "$__range": "60s"}
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def grafana_expr(expr: str) -> str:
    for name, value in GRAFANA_VARS.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a Grafana variable the test does not know: {expr}"
    return expr


def legend(fmt: str, labels: dict[str, str]) -> str:
    """What Grafana draws as a series' name (a missing label is empty)."""
    return LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), fmt)


@contextlib.asynccontextmanager
async def overloaded_backend() -> AsyncIterator[str]:
    """A backend whose probes pass and that answers every generation 503 (vLLM's overloaded):
    the proxy counts a backend error, ejects it and retries the request on another one."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def overloaded(request: web.Request) -> web.Response:
        await request.read()
        error = {"message": "overloaded", "type": "ServiceUnavailable", "param": None, "code": 503}
        return web.json_response({"error": error}, status=503)

    async def empty(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/health", empty)
    app.router.add_get("/metrics", empty)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", overloaded)
    async with serve_app(app, handler_cancellation=True) as url:
        yield url


async def call(
    s: aiohttp.ClientSession, base: str, tier: str, *, stream: bool = False, tokens: int = 4
) -> int:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"hello from {tier}"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    async with s.post(f"{base}/v1/chat/completions", json=body, headers=auth(tier)) as r:
        await r.read()  # a stream read to its end
        return r.status


async def leave_early(s: aiohttp.ClientSession, base: str) -> None:
    """A stream its client leaves after the first event: ``client_gone``, never a refusal."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "a long one"}],
        "max_tokens": 256,
        "ignore_eos": True,
        "stream": True,
    }
    async with s.post(f"{base}/v1/chat/completions", json=body, headers=auth("normal")) as r:
        assert r.status == 200
        await r.content.readline()
        r.close()


def errors_counted(states: list[ProxyState]) -> bool:
    registry = [s.metrics.registry for s in states]
    return any(
        m.name == "tierproxy_backend_errors" and m.samples for r in registry for m in r.collect()
    )


async def mixed_load(
    bases: list[str], states: list[ProxyState], prom: promserver.PrometheusServer
) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        # Two waves a scrape apart: a histogram's series appears with its first observation,
        # and a rate needs it to grow between two scrapes. The scrape counted, not slept on.
        for wave in range(2):
            if wave:
                await prom.scraped_since(time.time())
            statuses = await asyncio.gather(
                *(call(s, bases[i % 2], "high", tokens=8) for i in range(3)),
                *(call(s, bases[i % 2], "normal", stream=True) for i in range(3)),
                call(s, bases[wave], "low"),
            )
            assert set(statuses) == {200}, statuses
        await leave_early(s, bases[0])
        # tenant-low's requests_per_minute (2, shared through Redis) is spent: refused.
        assert await call(s, bases[1], "low") == 429
        # Until the overloaded backend drew one (the chooser may prefer vLLM at first).
        for i in range(20):
            if errors_counted(states):
                break
            assert await call(s, bases[i % 2], "normal") == 200
        assert errors_counted(states), "no request reached the overloaded backend"


def scrape_configs(admin_port: int, client_port: int, key_file: Path, vllm: str) -> list[Any]:
    return [
        {"job_name": "tierproxy", "static_configs": [{"targets": [f"127.0.0.1:{admin_port}"]}]},
        {
            # A replica without admin_listen: /metrics on the client listener, admin key only.
            "job_name": "tierproxy-client-listener",
            "authorization": {"type": "Bearer", "credentials_file": str(key_file)},
            "static_configs": [{"targets": [f"127.0.0.1:{client_port}"]}],
            "relabel_configs": [{"target_label": "job", "replacement": "tierproxy"}],
        },
        {"job_name": "vllm", "static_configs": [{"targets": [vllm.removeprefix("http://")]}]},
    ]


async def test_every_dashboard_expression_draws_one_series_per_legend_on_prometheus(
    engines: EngineFarm, tmp_path: Path
) -> None:
    if not promserver.available():
        pytest.skip(promserver.MISSING)
    if not RedisServer.available():
        pytest.skip("redis-server is not installed (make test installs it)")
    engine = engines.get(CORE)
    redis = RedisServer(tmp_path)
    redis.start()
    key_file = tmp_path / "admin_key"
    key_file.write_text(ADMIN_KEY)
    admin_port = free_port()

    def config(name: str, *, admin_listen: bool) -> dict[str, Any]:
        tenants = make_config([])["tenants"]
        tenants[2]["requests_per_minute"] = 2  # tenant-low
        cfg = make_config(
            [{"url": engine.spec.url, "max_inflight": 4}, {"url": flaky}],
            tenants=tenants,
            shared_state={"url": redis.url},
            usage_log={"path": str(tmp_path / f"{name}-usage.jsonl")},
            admin_keys=[{"sha256": hash_key(ADMIN_KEY)}],
            backend_health={"health_interval_s": 0.5, "metrics_interval_s": 0.5},
        )
        if admin_listen:
            cfg["admin_listen"] = {"host": "127.0.0.1", "port": admin_port}
        return cfg

    started = time.monotonic()
    try:
        async with (
            overloaded_backend() as flaky,
            running_proxy(config("a", admin_listen=True)) as (base_a, state_a),
            running_proxy(config("b", admin_listen=False)) as (base_b, state_b),
        ):
            client_port = int(base_b.rsplit(":", 1)[1])
            prom = promserver.PrometheusServer(
                tmp_path / "prometheus",
                scrape_configs(admin_port, client_port, key_file, engine.spec.url),
                interval_s=SCRAPE_S,
            )
            with prom:
                await prom.ready()
                await prom.targets_up(3)
                load_from = time.time()
                await mixed_load([base_a, base_b], [state_a, state_b], prom)
                scraped_at = await prom.scraped_since(time.time(), scrapes=2)  # after the load
                # The range ends at the last of those scrapes, in whole steps from its start: its
                # last step's rate window holds both (a series the load's end made, the tenant
                # refused, has no rate before them; a step that fell before the second, none).
                end = scraped_at + 0.01
                start = end - math.ceil(end - (load_from - 2 * SCRAPE_S))
                drawn = await evaluate_every_panel(prom, start, end)
    finally:
        redis.kill()
    assert len(drawn) >= 25  # every target of every panel
    print(f"dashboard on prometheus: {len(drawn)} expressions, {time.monotonic() - started:.1f}s")


async def evaluate_every_panel(
    prom: promserver.PrometheusServer, start: float, end: float
) -> dict[str, list[str]]:
    """Each target's legends, after checking: it parses, returns at least one series with a
    number (but the adapters' panels: no LoRA engine here), one series per legend within the
    target and within its panel."""
    drawn: dict[str, list[str]] = {}
    problems: list[str] = []
    for panel in panels():
        in_panel: list[str] = []
        for target in panel["targets"]:
            where = f"panel {panel['id']} ({panel['title']}) {target['refId']}"
            result = await prom.query_range(grafana_expr(target["expr"]), start, end, SCRAPE_S)
            names = [legend(target["legendFormat"], s["metric"]) for s in result]
            finite = any(math.isfinite(float(v)) for s in result for _, v in s["values"])
            # The adapters row needs a LoRA engine (tests/integration/test_adapters_vllm.py
            # drives those counters): here its expressions must parse, and draw one series per
            # legend when they draw any.
            lora_only = "tierproxy_adapter_" in target["expr"]
            if (not result or not finite) and not lora_only:
                problems.append(f"{where}: no data for {target['expr']}")
            if len(set(names)) != len(names):
                problems.append(f"{where}: one legend for several series: {sorted(names)}")
            if panel["id"] == 5:  # refusals only: never client_gone, never ok
                outcomes = {s["metric"].get("outcome") for s in result}
                if not outcomes <= REFUSAL_OUTCOMES:
                    problems.append(f"{where}: plots {outcomes - REFUSAL_OUTCOMES}")
            drawn[where] = names
            in_panel += names
        if len(set(in_panel)) != len(in_panel):
            problems.append(f"panel {panel['id']}: one legend for several series: {in_panel}")
    assert not problems, "\n".join(problems)
    return drawn
