"""Real proxy processes (`tierproxy serve`) sharing one Redis, in front of an in-process null
upstream, for the shared-state tests."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from redis.asyncio import Redis

from proxy.bench.inproc import KEYS, SECRET, auth, make_config
from proxy.bench.stack import ProxyProcess
from proxy.config.tenants import hash_key
from proxy.ops.process import ManagedProcess, free_port
from proxy.ticket import DEFAULT_SECRET_ENV

TENANT = "acme"

# Timings for a live Redis on a busy machine: a call past these is decided without Redis (by
# local limits), which a test of shared state then reads as a wrong count. A killed Redis
# refuses at once whatever these are. 2 s was passed in a full run beside a benchmark (the
# suite's half that Redis serves is niced): two replicas held four adapters of two slots.
LIVE_REDIS: dict[str, Any] = {"call_timeout_s": 10.0, "pool_wait_s": 10.0}


ADMIN_KEY = "replicas-admin-key"


async def day_counter(redis: Redis, tenant: str = TENANT) -> float:
    """The tenant's tokens_per_day counter in Redis: what it used, and the reservations of
    requests still on their way."""
    keys = [k async for k in redis.scan_iter(match=f"*quota:{{{tenant}}}:tokens_per_day:*")]
    values = [await redis.get(k) for k in keys]
    return sum(float(v or 0) for v in values)


def replica_config(upstream: str, redis_url: str | None, **tenant_limits: Any) -> dict[str, Any]:
    """One tenant (the normal tier's demo key) with ``tenant_limits``; shared state when
    ``redis_url`` is given."""
    tenant = {
        "name": TENANT,
        "tier": "normal",
        "keys": [{"sha256": hash_key(KEYS["normal"])}],
        **tenant_limits,
    }
    extra: dict[str, Any] = {}
    if redis_url is not None:
        extra["shared_state"] = {
            "url": redis_url,
            **LIVE_REDIS,  # no 429 at all in one loaded full run with the defaults
            "lease_ttl_s": 1.0,
            "probe_interval_s": 0.1,
        }
    # /metrics (metric() below) on the client listener needs an admin key.
    extra["admin_keys"] = [{"sha256": hash_key(ADMIN_KEY)}]
    return make_config([{"url": upstream, "max_inflight": 256}], tenants=[tenant], **extra)


async def start_replicas(
    n: int, config: dict[str, Any], workdir: Path, *, extra_args: list[str] | None = None
) -> list[ProxyProcess]:
    path = workdir / "proxy.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {DEFAULT_SECRET_ENV: SECRET.decode()}
    procs = [
        ProxyProcess(path, free_port(), workdir / f"replica-{i}.log", env=env) for i in range(n)
    ]
    if extra_args:
        for proc in procs:
            proc.command += extra_args
    try:
        await asyncio.gather(*(asyncio.to_thread(p.start, 60.0) for p in procs))
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return procs


async def post(
    session: aiohttp.ClientSession, base: str, max_tokens: int = 1, timeout_s: float = 30.0
) -> aiohttp.ClientResponse:
    body = {"model": "null", "messages": [{"role": "user", "content": "hi"}]}
    body["max_tokens"] = max_tokens  # type: ignore[assignment]
    async with session.post(
        f"{base}/v1/chat/completions",
        json=body,
        headers=auth("normal"),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as resp:
        await resp.read()
        return resp


async def metric(session: aiohttp.ClientSession, base: str, name: str) -> float:
    async with session.get(
        f"{base}/metrics",
        timeout=aiohttp.ClientTimeout(total=5),
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    ) as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {base}/metrics")


def owner(config: dict[str, object], tmp_path: Path, port: int) -> ManagedProcess:
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "proxy.cli", "serve", "-c", str(path)]
    command += ["--workers", "2", "--port", str(port)]
    env = {**os.environ, DEFAULT_SECRET_ENV: SECRET.decode()}
    return ManagedProcess(command, env=env, log_path=tmp_path / "owner.log", name="owner")
