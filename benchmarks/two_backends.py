"""Throughput through the proxy over two engines against the two engines driven directly.

Starts two stock vLLM CPU servers (tiny model, --max-num-seqs N), then runs the same
closed-loop load (C concurrent clients, non-streaming, fixed output length) for D seconds:
  1. directly, half the clients on each engine (the best a client-side split can do);
  2. through the proxy, all clients on one URL, the proxy metering into both engines.
Prints requests/s and output tokens/s of both runs and their ratio (aim: >= 0.95).

    .venv/bin/python benchmarks/two_backends.py --duration 30 --clients 16
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from proxyrun import auth, make_config, running_proxy

from proxy.engine import (
    EngineProcess,
    EngineSpec,
    ensure_model,
    free_port,
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


async def _run(args: argparse.Namespace, engines: list[EngineProcess]) -> None:
    urls = [e.spec.url for e in engines]
    warm = await _closed_loop(urls, 4, 3.0, args.max_tokens, {})
    print(f"warm-up: {warm[0]} requests")
    d_done, d_tok, d_fail = await _closed_loop(
        urls, args.clients, args.duration, args.max_tokens, {}
    )
    cfg = make_config([{"url": u, "max_inflight": args.max_num_seqs} for u in urls])
    async with running_proxy(cfg) as (base, _):
        p_done, p_tok, p_fail = await _closed_loop(
            [base], args.clients, args.duration, args.max_tokens, auth("normal")
        )
    d = args.duration
    print(f"\n{'':18}{'requests/s':>12}{'output tok/s':>14}{'failed':>8}")
    print(f"{'direct (2 engines)':18}{d_done / d:12.1f}{d_tok / d:14.1f}{d_fail:8d}")
    print(f"{'through the proxy':18}{p_done / d:12.1f}{p_tok / d:14.1f}{p_fail:8d}")
    print(f"\nratio proxy/direct (output tokens/s): {p_tok / max(d_tok, 1):.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--no-plugin", action="store_true", help="stock vLLM, without the plugin")
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
                plugin=not args.no_plugin,
            ),
            Path(f".tierproxy/logs/two-backends-{i}.log"),
        )
        for i in range(2)
    ]
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
        asyncio.run(_run(args, engines))
    finally:
        for e in engines:
            e.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
