"""Throughput through the proxy over two engines against the two engines driven directly.

Starts two stock vLLM CPU servers (tiny model, --max-num-seqs N), then runs the same
closed-loop load (C concurrent clients, non-streaming, fixed output length) for D seconds:
  1. directly, half the clients on each engine (the best a client-side split can do);
  2. through the proxy (its own process), all clients on one URL, metering into both engines.
The two alternate for --rounds rounds, so drift in a shared machine's load hits both alike.
Prints requests/s and output tokens/s of both runs and their ratio (aim: >= 0.95).

    .venv/bin/python benchmarks/two_backends.py --duration 30 --clients 16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tests.proxyrun import SECRET, auth, make_config

from proxy.engine import (
    EngineProcess,
    EngineSpec,
    engine_cores,
    ensure_model,
    free_port,
    http_ok,
    spread_cores,
)


async def _closed_loop(
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


async def _run(args: argparse.Namespace, engines: list[EngineProcess], proxy_url: str) -> None:
    urls = [e.spec.url for e in engines]
    warm = await _closed_loop(urls, 4, 3.0, args.max_tokens, {})
    print(f"warm-up: {warm[0]} requests")
    d = args.duration
    rows = []
    # Alternate the two paths so that drift in a shared machine's load hits both alike.
    for round_ in range(args.rounds):
        direct = await _closed_loop(urls, args.clients, d, args.max_tokens, {})
        proxied = await _closed_loop([proxy_url], args.clients, d, args.max_tokens, auth("normal"))
        rows.append((round_, direct, proxied))
    print(f"\n{'':24}{'requests/s':>12}{'output tok/s':>14}{'failed':>8}")
    for round_, direct, proxied in rows:
        for label, (done, tokens, failed) in (("direct (2 engines)", direct), ("proxy", proxied)):
            name = f"{label} #{round_ + 1}"
            print(f"{name:24}{done / d:12.1f}{tokens / d:14.1f}{failed:8d}")
    d_total = sum(r[1][1] for r in rows)
    p_total = sum(r[2][1] for r in rows)
    print(f"\nratio proxy/direct (output tokens/s, all rounds): {p_total / max(d_total, 1):.3f}")


def _start_proxy(
    args: argparse.Namespace, urls: list[str], workdir: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """The proxy in its own process, as in production (not sharing the load generator's core)."""
    port = free_port()
    cfg = make_config([{"url": u, "max_inflight": args.max_num_seqs} for u in urls])
    cfg["listen"] = {"host": "127.0.0.1", "port": port}
    path = workdir / "two-backends-proxy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "TIERPROXY_TICKET_SECRET": SECRET.decode()}
    log = (workdir / "two-backends-proxy.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "-c", str(path)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not http_ok(f"{url}/readyz", timeout_s=1.0):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the proxy did not start; see {workdir / 'two-backends-proxy.log'}")
        time.sleep(0.2)
    return proc, url


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--no-plugin", action="store_true", help="stock vLLM, without the plugin")
    parser.add_argument("--rounds", type=int, default=2, help="direct/proxy pairs, alternated")
    args = parser.parse_args()
    model, served = ensure_model(None)
    engines = [
        EngineProcess(
            EngineSpec(
                port=free_port(),
                model=model,
                served_name=served,
                max_num_seqs=args.max_num_seqs,
                cpu_bind=spread_cores(i),
                cpus=engine_cores(),
                plugin=not args.no_plugin,
            ),
            Path(f".tierproxy/logs/two-backends-{i}.log"),
        )
        for i in range(2)
    ]
    proxy: subprocess.Popen[bytes] | None = None
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
        proxy, proxy_url = _start_proxy(
            args, [e.spec.url for e in engines], Path(".tierproxy/logs")
        )
        asyncio.run(_run(args, engines, proxy_url))
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(timeout=15)
        for e in engines:
            e.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
