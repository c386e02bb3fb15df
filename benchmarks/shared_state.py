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
import tempfile
import time
from pathlib import Path

import aiohttp

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.redis_server import RedisServer
from proxy.bench.replica_latency import config, latencies, pct, send, start


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
