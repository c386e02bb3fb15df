"""A whole reconciliation run: `tierproxy serve` (a subprocess on its default loop) with a usage
log and the mix's tenants in front of one engine, each category in turn (concurrent inside),
the engine's counters read between categories once it runs nothing; with Redis, a stall longer
than ``call_timeout_s`` (the server stopped by SIGSTOP) and a restart (SIGKILL, then started on
its port again from its append-only file) while requests run."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from proxy.bench.inproc import make_config
from proxy.bench.reconcile.client import Sent, send
from proxy.bench.reconcile.ledger import (
    CategoryFigures,
    CounterFigure,
    Reconciliation,
    records_of,
    settled_engine_counts,
    usage_records,
    wait_for_records,
)
from proxy.bench.reconcile.mix import MODEL, PRICE, Planned, TenantPlan, plan, tenants
from proxy.bench.redis_server import RedisServer
from proxy.bench.stack import ProxyProcess
from proxy.config.tenants import hash_key
from proxy.ops.process import free_port
from proxy.ops.runtime import LOOP_ENV
from proxy.scheduling.quotas import period
from proxy.ticket import DEFAULT_SECRET_ENV

# Past it the relay refuses a non-stream answer (502): the "big" category's answers (top-20
# logprobs of each prompt and output token, ~1.5 KB a token) spread across it.
MAX_RESPONSE_BYTES = 384 * 1024
CALL_TIMEOUT_S = 0.25
QUEUE_TIMEOUT_S = 5.0
STALL_S = 2.0  # longer than CALL_TIMEOUT_S
TROUBLE_DELAY_S = 0.3  # into a category's requests
RESTART_AFTER_S = 1.0
ADMIN_KEY = "admin-key-of-the-reconciliation"
STATUS_TIMEOUT = aiohttp.ClientTimeout(total=10)


@dataclass(frozen=True)
class Settings:
    per_category: int = 9
    concurrency: int = 4
    seed: int = 30
    redis: bool = False
    scale: float = 1.0  # the quotas' size (a longer run wants larger ones)


def proxy_config(
    engine_url: str, log: Path, people: list[TenantPlan], redis_url: str | None
) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "pricing": {MODEL: PRICE, "*": PRICE},
        "usage_log": {"path": str(log)},
        "relay": {"max_response_bytes": MAX_RESPONSE_BYTES},
        "admin_listen": {"host": "127.0.0.1", "port": free_port()},
        "admin_keys": [{"sha256": hash_key(ADMIN_KEY)}],
    }
    if redis_url is not None:
        extra["shared_state"] = {
            "url": redis_url,
            "call_timeout_s": CALL_TIMEOUT_S,
            "probe_interval_s": 0.1,
            "on_failure": "local",
        }
    backends = [{"url": engine_url, "max_inflight": 4}]
    # A queue that stops moving (seen after the Redis troubles) costs seconds, not minutes.
    tiers = {"normal": {"queue_timeout_s": QUEUE_TIMEOUT_S}}
    return make_config(backends, tiers=tiers, tenants=[t.config() for t in people], **extra)


def _start(
    engine_url: str, workdir: Path, settings: Settings
) -> tuple[ProxyProcess, RedisServer | None, dict[str, Any]]:
    """Redis (with shared state) and the served proxy, up; its config."""
    workdir.mkdir(parents=True, exist_ok=True)
    redis = RedisServer(workdir, appendonly=True) if settings.redis else None
    if redis is not None:
        redis.start()
    people = tenants(settings.scale)
    config = proxy_config(engine_url, workdir / "usage.jsonl", people, redis.url if redis else None)
    config_path = workdir / "proxy.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != LOOP_ENV}  # its default loop: uvloop
    env[DEFAULT_SECRET_ENV] = secrets.token_urlsafe(32)
    proxy = ProxyProcess(config_path, free_port(), workdir / "proxy.log", env=env)
    proxy.env = env
    try:
        proxy.start()
    except BaseException:
        if redis is not None:
            redis.kill()
        raise
    return proxy, redis, config


async def reconcile(engine_url: str, workdir: Path, settings: Settings) -> Reconciliation:
    """One run (``workdir``: the proxy's config, log and usage log, Redis's files)."""
    proxy, redis, config = await asyncio.to_thread(_start, engine_url, workdir, settings)
    people = tenants(settings.scale)
    try:
        async with aiohttp.ClientSession() as session:
            log = workdir / "usage.jsonl"
            result = await _drive(session, proxy.url, engine_url, log, settings, redis)
            admin = f"http://127.0.0.1:{config['admin_listen']['port']}"
            phases = plan(settings.per_category, settings.seed, settings.scale)
            result.counters = await _counters(session, admin, redis, people, phases)
            result.counter_tokens = sum(
                c.used for c in result.counters if c.counter == "tokens_per_day"
            )
        return result
    finally:
        proxy.stop()
        if redis is not None:
            redis.kill()


async def _drive(
    session: aiohttp.ClientSession,
    base: str,
    engine_url: str,
    log: Path,
    settings: Settings,
    redis: RedisServer | None,
) -> Reconciliation:
    phases = plan(settings.per_category, settings.seed, settings.scale)
    events: list[str] = []
    start = time.monotonic()
    figures: list[CategoryFigures] = []
    for category, planned in phases.items():
        before = await settled_engine_counts(session, engine_url)
        trouble = TROUBLES.get(category) if redis is not None else None
        task: asyncio.Task[None] | None = None
        if trouble is not None and redis is not None:
            task = asyncio.create_task(trouble(redis, events, start))
        sent = await _send_all(session, base, planned, settings.concurrency)
        if task is not None:
            await task
        await wait_for_records(log, {p.request_id for p in planned})
        after = await settled_engine_counts(session, engine_url)
        records = records_of(usage_records(log), planned)
        figures.append(CategoryFigures(category, sent, records, after - before))
    return Reconciliation(figures, events=events)


async def _send_all(
    session: aiohttp.ClientSession, base: str, planned: list[Planned], concurrency: int
) -> list[Sent]:
    gate = asyncio.Semaphore(concurrency)

    async def one(p: Planned) -> Sent:
        async with gate:
            return await send(session, base, p)

    return list(await asyncio.gather(*(one(p) for p in planned)))


async def _stall(redis: RedisServer, events: list[str], start: float) -> None:
    """SIGSTOP: connections stay open, nothing answers (a fork, a slow fsync, a blip)."""
    await asyncio.sleep(TROUBLE_DELAY_S)  # requests of the phase in flight
    proc = redis.proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGSTOP)
    events.append(f"stalled {STALL_S:.1f} s at {time.monotonic() - start:.1f} s")
    try:
        await asyncio.sleep(STALL_S)
    finally:
        os.kill(proc.pid, signal.SIGCONT)


async def _restart(redis: RedisServer, events: list[str], start: float) -> None:
    """SIGKILL, then the same port again, from its append-only file."""
    await asyncio.sleep(TROUBLE_DELAY_S)
    redis.kill()
    events.append(f"killed at {time.monotonic() - start:.1f} s")
    await asyncio.sleep(RESTART_AFTER_S)
    await asyncio.to_thread(redis.start)
    events.append(f"restarted at {time.monotonic() - start:.1f} s")


Trouble = Callable[[RedisServer, list[str], float], Coroutine[Any, Any, None]]
# With Redis: what happens to it while a category's requests run.
TROUBLES: dict[str, Trouble] = {"cut": _stall, "n": _restart, "big": _stall}


def _worst(
    people: list[TenantPlan], phases: dict[str, list[Planned]]
) -> dict[str, tuple[int, int]]:
    """Each tenant's largest reservation: (tokens, money at PRICE: 1 a prompt token, 4 an
    output token)."""
    worst: dict[str, tuple[int, int]] = {t.name: (0, 0) for t in people}
    for planned in (p for ps in phases.values() for p in ps):
        tokens = planned.worst_tokens()
        out = planned.choices * int(planned.body["max_tokens"])
        money = (tokens - out) + 4 * out
        old = worst[planned.tenant.name]
        worst[planned.tenant.name] = (max(old[0], tokens), max(old[1], money))
    return worst


async def _counters(
    session: aiohttp.ClientSession,
    admin: str,
    redis: RedisServer | None,
    people: list[TenantPlan],
    phases: dict[str, list[Planned]],
) -> list[CounterFigure]:
    """Each tenant's day counters once they stop moving (settles land after the answers; with
    Redis, a replica's catch-up after the restart too): from Redis itself when shared."""
    read: Callable[[], Awaitable[dict[tuple[str, str], float]]]
    if redis is not None:
        read = lambda: _redis_counters(redis, people)  # noqa: E731
    else:
        read = lambda: _admin_counters(session, admin)  # noqa: E731
    last = await read()
    for _ in range(40):
        await asyncio.sleep(0.25)
        now = await read()
        if now == last:
            break
        last = now
    worst = _worst(people, phases)
    figures = []
    for t in people:
        for counter, limit in t.quota.items():
            if not counter.endswith("_per_day"):
                continue
            w = worst[t.name][0 if counter.startswith("tokens") else 1]
            used = last.get((t.name, counter), 0.0)
            figures.append(CounterFigure(t.name, counter, used, float(limit), float(w)))
    return figures


async def _admin_counters(
    session: aiohttp.ClientSession, admin: str
) -> dict[tuple[str, str], float]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with session.get(f"{admin}/admin/status", headers=headers, timeout=STATUS_TIMEOUT) as r:
        status = await r.json()
    out: dict[tuple[str, str], float] = {}
    for row in status.get("tenants", []):
        for counter, figure in (row.get("quota") or {}).items():
            out[(row["name"], counter)] = float(figure.get("used") or 0.0)
    return out


async def _redis_counters(
    redis: RedisServer, people: list[TenantPlan]
) -> dict[tuple[str, str], float]:
    """The day keys of each tenant's counters, read from Redis (whatever their prefix or
    version): ``...quota...{tenant}...:counter:YYYY-MM-DD``."""
    import redis.asyncio as aioredis

    day = period("day", time.time())[0]
    client = aioredis.Redis.from_url(redis.url, socket_timeout=5)
    out: dict[tuple[str, str], float] = {}
    try:
        async for raw in client.scan_iter(match="*quota*", count=1000):
            key = raw.decode()
            for t in people:
                for counter in t.quota:
                    if f"{{{t.name}}}" in key and f":{counter}:" in key and str(day) in key:
                        value = await client.get(raw)
                        out[(t.name, counter)] = out.get((t.name, counter), 0.0) + float(value or 0)
    finally:
        await client.aclose()
    return out
