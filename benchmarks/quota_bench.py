"""What quotas cost and whether they hold (docs/quotas.md).

1. Added latency: one `tierproxy serve` process in front of a null upstream, requests one at a
   time and 8 at a time, the tenant without and with a quota (tokens and budget per day and
   month, a price table), each without and with ``shared_state`` (a real local redis-server),
   measured in alternating rounds.
2. Accuracy: 2 replicas sharing one Redis, a tenant with ``tokens_per_day``, hammered
   round-robin until refused; the tokens the backend reported for the answered requests
   against the quota (never above it), and the same without shared state (each replica its
   own quota: up to twice).

    python benchmarks/quota_bench.py [--requests 400]

Needs redis-server on PATH. Timings on a shared machine are best read as ratios within a run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

import aiohttp

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.redis_server import RedisServer
from proxy.bench.replica_latency import config, latencies, pct, send, start

QUOTA = {
    "tokens_per_day": 10**12,
    "tokens_per_month": 10**13,
    "budget_per_day": 10**9,
    "budget_per_month": 10**10,
}
PRICING = {"null": {"input": 0.15, "cached_input": 0.075, "output": 0.6}}
USED_PER_ANSWER = 8  # the null upstream reports 4 + 4 tokens


async def added_latency(upstream: str, redis: RedisServer, workdir: Path, requests: int) -> None:
    print("latency (ms), one proxy process each, null upstream, alternating rounds")
    print(f"{'':>28} {'conc':>4} {'p50':>7} {'p99':>7}")
    for url in (None, redis.url):
        plain_cfg = config(upstream, url)
        quota_cfg = {**config(upstream, url, quota=QUOTA), "pricing": PRICING}
        (plain,) = await start(1, plain_cfg, workdir)
        (quota,) = await start(1, quota_cfg, workdir)
        where = "redis" if url else "local"
        try:
            for concurrency in (1, 8):
                without, with_ = await latencies([plain.url, quota.url], requests, concurrency)
                for label, lat in ((f"no quota ({where})", without), (f"quota ({where})", with_)):
                    print(f"{label:>28} {concurrency:>4} {pct(lat, 50):7.2f} {pct(lat, 99):7.2f}")
        finally:
            plain.stop()
            quota.stop()


async def accuracy(upstream: str, redis: RedisServer, workdir: Path) -> None:
    limit = 2000
    print(f"\naccuracy: tokens_per_day {limit}, 2 replicas, 8 clients round-robin until refused")
    print(f"{'shared':>6} {'answered':>8} {'tokens used':>11} {'quota':>6}")
    for shared in (True, False):
        redis.kill()
        redis.start()
        url = redis.url if shared else None
        procs = await start(2, config(upstream, url, quota={"tokens_per_day": limit}), workdir)
        answered = 0
        try:
            async with aiohttp.ClientSession() as session:
                bases = [p.url for p in procs]

                async def client(i: int, bases: list[str]) -> None:
                    nonlocal answered
                    refused_in_a_row = 0
                    while refused_in_a_row < 4:
                        status, _ = await send(session, bases[i % 2])
                        if status == 200:
                            answered += 1
                            refused_in_a_row = 0
                        else:
                            assert status == 429, status
                            refused_in_a_row += 1
                        i += 1

                await asyncio.gather(*(client(i, bases) for i in range(8)))
        finally:
            for proc in procs:
                proc.stop()
        used = answered * USED_PER_ANSWER
        print(f"{shared!s:>6} {answered:>8} {used:>11} {limit:>6}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        redis = RedisServer(workdir)
        redis.start()
        null = FakeVLLM(model="null", usage=(4, 4))
        try:
            async with null.serve() as upstream:
                await added_latency(upstream, redis, workdir, args.requests)
                await accuracy(upstream, redis, workdir)
        finally:
            redis.kill()
    print(f"\n(cpu count {os.cpu_count()}; a shared machine: compare rows within this run)")


if __name__ == "__main__":
    asyncio.run(main())
