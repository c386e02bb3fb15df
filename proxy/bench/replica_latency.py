"""Replicas of `tierproxy serve` for the shared-state benchmarks (``benchmarks/shared_state.py``,
``benchmarks/quota_bench.py``): a config with one limited tenant and optional
``shared_state``, n processes started on it, and latencies measured in alternating rounds."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from proxy.bench.inproc import KEYS, SECRET, auth, make_config
from proxy.bench.stack import ProxyProcess
from proxy.config.tenants import hash_key
from proxy.ops.process import free_port
from proxy.ticket import DEFAULT_SECRET_ENV

BODY = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def config(upstream: str, redis_url: str | None, **limits: Any) -> dict[str, Any]:
    tenant = {"name": "acme", "tier": "normal", "keys": [{"sha256": hash_key(KEYS["normal"])}]}
    extra: dict[str, Any] = {}
    if redis_url is not None:
        extra["shared_state"] = {"url": redis_url}
    return make_config(
        [{"url": upstream, "max_inflight": 256}], tenants=[{**tenant, **limits}], **extra
    )


async def start(n: int, cfg: dict[str, Any], workdir: Path) -> list[ProxyProcess]:
    path = workdir / f"proxy-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {DEFAULT_SECRET_ENV: SECRET.decode()}
    procs = [
        ProxyProcess(path, free_port(), workdir / f"replica-{i}.log", env=env) for i in range(n)
    ]
    await asyncio.gather(*(asyncio.to_thread(p.start, 60.0) for p in procs))
    return procs


async def send(session: aiohttp.ClientSession, base: str) -> tuple[int, float]:
    started = time.perf_counter()
    async with session.post(f"{base}/v1/chat/completions", json=BODY, headers=auth("normal")) as r:
        await r.read()
        return r.status, time.perf_counter() - started


async def latencies(
    bases: list[str], requests: int, concurrency: int, rounds: int = 8
) -> list[list[float]]:
    """Latencies through each of ``bases``, measured in alternating rounds (so that the load
    of a shared machine falls on all of them alike)."""
    out: list[list[float]] = [[] for _ in bases]
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for base in bases:  # warm-up: connections, scripts loaded, pools
            for _ in range(20):
                await send(session, base)
        per_round = max(1, requests // rounds)
        for _ in range(rounds):
            for base, into in zip(bases, out, strict=True):
                done: list[float] = []

                async def worker(base: str, done: list[float]) -> None:
                    while len(done) < per_round:
                        status, took = await send(session, base)
                        assert status == 200, status
                        done.append(took)

                await asyncio.gather(*(worker(base, done) for _ in range(concurrency)))
                into.extend(done)
    return out


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] * 1000
