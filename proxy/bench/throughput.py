"""Closed-loop throughput: C clients, each sending its next request when the last one is
answered (non-streaming, fixed output length), directly to engines or through the proxy.
Used by benchmarks/two_backends.py."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import aiohttp
import yaml

from proxy.bench.inproc import SECRET, auth, make_config
from proxy.bench.stack import ProxyProcess
from proxy.ops.process import free_port
from proxy.ticket import DEFAULT_SECRET_ENV
from proxy.tools.engine import EngineProcess


async def closed_loop(
    urls: list[str], clients: int, duration_s: float, max_tokens: int, headers: dict[str, str]
) -> tuple[int, int, int]:
    body = {
        "model": "tiny",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Summarise the queueing story."}],
    }
    done = tokens = failed = 0
    stop_at = time.monotonic() + duration_s
    timeout = aiohttp.ClientTimeout(total=60)

    async def client(url: str) -> None:
        nonlocal done, tokens, failed
        async with aiohttp.ClientSession(timeout=timeout) as s:
            while time.monotonic() < stop_at:
                async with s.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                    data = await r.json()
                if r.status == 200:
                    done += 1
                    tokens += data["usage"]["completion_tokens"]
                else:
                    failed += 1

    await asyncio.gather(*(client(urls[i % len(urls)]) for i in range(clients)))
    return done, tokens, failed


async def compare(args: argparse.Namespace, engines: list[EngineProcess], proxy_url: str) -> None:
    urls = [e.spec.url for e in engines]
    warm = await closed_loop(urls, 4, 3.0, args.max_tokens, {})
    print(f"warm-up: {warm[0]} requests")
    d = args.duration
    rows = []
    # Alternate the two paths so that drift in a shared machine's load hits both alike.
    for round_ in range(args.rounds):
        direct = await closed_loop(urls, args.clients, d, args.max_tokens, {})
        proxied = await closed_loop([proxy_url], args.clients, d, args.max_tokens, auth("normal"))
        rows.append((round_, direct, proxied))
    print(f"\n{'':24}{'requests/s':>12}{'output tok/s':>14}{'failed':>8}")
    for round_, direct, proxied in rows:
        for label, (done, tokens, failed) in (("direct (2 engines)", direct), ("proxy", proxied)):
            name = f"{label} #{round_ + 1}"
            print(f"{name:24}{done / d:12.1f}{tokens / d:14.1f}{failed:8d}")
    d_total = sum(r[1][1] for r in rows)
    p_total = sum(r[2][1] for r in rows)
    print(f"\nratio proxy/direct (output tokens/s, all rounds): {p_total / max(d_total, 1):.3f}")


def start_proxy(urls: list[str], max_inflight: int, workdir: Path) -> ProxyProcess:
    """The proxy in its own process, as in production (not sharing the load generator's core),
    metering into ``urls``; the tiers' demo keys of proxy.bench.inproc."""
    port = free_port()
    cfg = make_config([{"url": u, "max_inflight": max_inflight} for u in urls])
    cfg["listen"] = {"host": "127.0.0.1", "port": port}
    path = workdir / "two-backends-proxy.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    proxy = ProxyProcess(
        path, port, workdir / "two-backends-proxy.log", env={DEFAULT_SECRET_ENV: SECRET.decode()}
    )
    return proxy.start(ready_timeout_s=30.0)
