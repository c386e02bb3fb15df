"""What shared_state costs and what it buys (docs/scale-out.md).

1. Added latency: one proxy process (`tierproxy serve`) in front of a null upstream, requests
   one at a time and 8 at a time, without and with ``shared_state`` (a real local
   redis-server); the tenant has rpm, tpm and max_concurrent limits, so every request runs the
   admit and settle scripts and takes and gives back backend room.
2. rpm accuracy: 2 and 4 replicas sharing one Redis, a tenant limited to 120 rpm (a bucket of
   120 refilled at 2/s), hammered round-robin for a few seconds; admitted vs the exact figure
   ``120 + 2 x seconds``, and the same without shared state.

    python benchmarks/shared_state.py [--requests 400] [--seconds 5]

Needs redis-server on PATH (Debian: apt-get install redis-server). Timings on a shared machine
are best read as ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import KEYS, SECRET, auth, make_config
from proxy.bench.redis_server import RedisServer
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


async def added_latency(upstream: str, redis: RedisServer, workdir: Path, requests: int) -> None:
    limits = {"requests_per_minute": 10**7, "tokens_per_minute": 10**9, "max_concurrent": 1000}
    print("latency (ms), one proxy process each, null upstream, alternating rounds")
    print(f"{'':>22} {'conc':>4} {'p50':>7} {'p99':>7}")
    (alone,) = await start(1, config(upstream, None, **limits), workdir)
    (shared,) = await start(1, config(upstream, redis.url, **limits), workdir)
    try:
        for concurrency in (1, 8):
            without, with_ = await latencies([alone.url, shared.url], requests, concurrency)
            for label, lat in (("without shared_state", without), ("with shared_state", with_)):
                print(f"{label:>22} {concurrency:>4} {pct(lat, 50):7.2f} {pct(lat, 99):7.2f}")
    finally:
        alone.stop()
        shared.stop()


async def hammer(bases: list[str], seconds: float, clients: int) -> int:
    """Requests round-robin over ``bases`` from ``clients`` loops; how many got 200."""
    admitted = 0
    stop_at = time.monotonic() + seconds
    async with aiohttp.ClientSession() as session:

        async def client(i: int) -> None:
            nonlocal admitted
            n = i
            while time.monotonic() < stop_at:
                status, _ = await send(session, bases[n % len(bases)])
                admitted += status == 200
                n += 1

        await asyncio.gather(*(client(i) for i in range(clients)))
    return admitted


async def rpm_accuracy(upstream: str, redis: RedisServer, workdir: Path, seconds: float) -> None:
    rpm = 120
    print(f"\nrpm accuracy: limit {rpm}/min (bucket {rpm}, refill {rpm / 60:g}/s), {seconds:g} s")
    print(f"{'replicas':>8} {'shared':>6} {'admitted':>8} {'exact':>7} {'ratio':>6}")
    for replicas in (2, 4):
        for shared in (True, False):
            redis.kill()
            redis.start()  # a fresh bucket
            url = redis.url if shared else None
            procs = await start(replicas, config(upstream, url, requests_per_minute=rpm), workdir)
            try:
                began = time.monotonic()
                admitted = await hammer([p.url for p in procs], seconds, 4 * replicas)
                elapsed = time.monotonic() - began
            finally:
                for proc in procs:
                    proc.stop()
            exact = rpm + rpm / 60 * elapsed
            print(f"{replicas:>8} {shared!s:>6} {admitted:>8} {exact:7.1f} {admitted / exact:6.3f}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        redis = RedisServer(workdir)
        redis.start()
        null = FakeVLLM(model="null", usage=(4, 4))
        try:
            async with null.serve() as upstream:
                await added_latency(upstream, redis, workdir, args.requests)
                await rpm_accuracy(upstream, redis, workdir, args.seconds)
        finally:
            redis.kill()
    print(f"\n(cpu count {os.cpu_count()}; a shared machine: compare rows within this run)")


if __name__ == "__main__":
    asyncio.run(main())
