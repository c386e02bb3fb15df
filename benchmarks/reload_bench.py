"""Loading and live-reloading a 10,000-tenant config, and what a reload costs the requests.

    python benchmarks/reload_bench.py [--tenants 10000] [--seconds 8] [--clients 8]

Prints: the time to parse and validate the file (``parse_config``; the old pure-Python
``yaml.compose`` + ``yaml.safe_load`` path for comparison) and the wall time of ``tierproxy
check``; then the real app in-process in front of an in-process fake backend, with clients
sending requests back to back, first with no reload, then while the file is rewritten (atomic
rename) and reloaded again and again: request latency in both phases, the number of reloads and
the time each spent on the event loop (the commit of ``ProxyState.prepare``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import KEYS, auth, make_config, running_proxy, until
from proxy.config.loader import parse_config
from proxy.config.schema import LoadedConfig
from proxy.ops.runtime import tune_gc
from proxy.server.state import ProxyState

TIERS = ("high", "normal", "low")


def big_config(backend_url: str, tenants: int, weight: float = 1.0) -> dict[str, Any]:
    """make_config's demo tenants plus ``tenants`` more, each with a sha256 key."""
    extra = [
        {
            "name": f"bulk-{i}",
            "tier": TIERS[i % 3],
            "keys": [{"sha256": hashlib.sha256(f"bulk-key-{i}".encode()).hexdigest()}],
            "weight": weight,
            "requests_per_minute": 600,
        }
        for i in range(tenants)
    ]
    demo = [
        {"name": f"tenant-{tier}", "tier": tier, "keys": [{"env": "RELOAD_BENCH_KEY_" + tier}]}
        for tier in KEYS
    ]
    return make_config([{"url": backend_url, "max_inflight": 64}], tenants=demo + extra)


def time_loading(text: str, path: Path) -> None:
    best = min(_timed(lambda: parse_config(text, "bench")) for _ in range(3))
    old = _timed(lambda: (yaml.compose(text), yaml.safe_load(text)))
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check", "-c", str(path)],
        check=True,
        capture_output=True,
    )
    check = time.perf_counter() - started
    print(f"parse_config (best of 3):             {best * 1e3:8.0f} ms")
    print(f"old path: yaml.compose + safe_load:   {old * 1e3:8.0f} ms  (parsing alone)")
    print(f"`tierproxy check` (whole process):    {check * 1e3:8.0f} ms")


def _timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


async def client_loop(base: str, stop: asyncio.Event, latencies: list[float]) -> None:
    body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            started = time.perf_counter()
            async with http.post(
                f"{base}/v1/chat/completions", json=body, headers=auth("high")
            ) as resp:
                await resp.read()
                assert resp.status == 200, resp.status
            latencies.append(time.perf_counter() - started)


def reweighted(config: dict[str, Any]) -> list[str]:
    """Two versions of the file that differ from the first and from each other (weights)."""
    return [
        yaml.safe_dump({**config, "tenants": [{**t, "weight": w} for t in config["tenants"]]})
        for w in (2.0, 3.0)
    ]


async def reload_loop(state: ProxyState, path: Path, texts: list[str], stop: asyncio.Event) -> int:
    """Rewrite the file (write a temp file, rename it over) and wait for each reload to be
    applied; returns how many were."""
    count = 0
    while not stop.is_set():
        generation = state.metrics.config_generation._value.get()
        tmp = path.with_suffix(".tmp")
        await asyncio.to_thread(tmp.write_text, texts[count % 2])
        os.replace(tmp, path)  # atomic: the watcher sees the old file or the new one

        def applied(before: float = generation) -> bool:
            return bool(state.metrics.config_generation._value.get() > before)

        await until(applied, 30, "a reload")
        count += 1
    return count


async def measure(base: str, clients: int, seconds: float, during: Any = None) -> list[float]:
    latencies: list[float] = []
    stop = asyncio.Event()
    tasks = [asyncio.create_task(client_loop(base, stop, latencies)) for _ in range(clients)]
    side = asyncio.create_task(during(stop)) if during is not None else None
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)
    if side is not None:
        print(f"  reloads applied: {await side}")
    return latencies


def report(name: str, latencies: list[float]) -> None:
    ordered = sorted(latencies)
    p99 = ordered[int(len(ordered) * 0.99)]
    print(
        f"{name:16} requests {len(ordered):6d}  p50 {statistics.median(ordered) * 1e3:6.1f} ms"
        f"  p99 {p99 * 1e3:6.1f} ms  max {ordered[-1] * 1e3:6.1f} ms"
    )


async def run(tenants: int, seconds: float, clients: int, workdir: Path) -> None:
    for tier, key in KEYS.items():
        os.environ["RELOAD_BENCH_KEY_" + tier] = key
    async with FakeVLLM(usage=(5, 1)).serve() as backend:
        config = big_config(backend, tenants)
        path = workdir / "config.yaml"
        text = yaml.safe_dump(config)
        path.write_text(text)
        time_loading(text, path)
        async with running_proxy(config, path) as (base, state):
            assert state.watcher is not None
            applies: list[float] = []
            prepare = state.watcher.prepare

            def timed_prepare(loaded: LoadedConfig) -> Callable[[], object]:
                commit = prepare(loaded)  # in the worker thread

                def timed_commit() -> object:  # on the event loop
                    started = time.perf_counter()
                    replaced = commit()
                    applies.append(time.perf_counter() - started)
                    return replaced

                return timed_commit

            state.watcher.prepare = timed_prepare
            await until(lambda: state.pool.any_available(state.clock()), 30, "the backend")
            tune_gc()  # as `tierproxy serve` does once started
            await measure(base, clients, 1.0)  # warm-up
            quiet = await measure(base, clients, seconds)
            texts = reweighted(config)  # made before: yaml.safe_dump would block the loop
            busy = await measure(
                base, clients, seconds, lambda stop: reload_loop(state, path, texts, stop)
            )
    report("no reload", quiet)
    report("while reloading", busy)
    if applies:
        print(
            f"commit on the event loop: mean {statistics.mean(applies) * 1e3:.1f} ms,"
            f" max {max(applies) * 1e3:.1f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tenants", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        asyncio.run(run(args.tenants, args.seconds, args.clients, Path(workdir)))


if __name__ == "__main__":
    main()
