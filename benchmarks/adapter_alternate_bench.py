"""Red team F2 against a running engine (`--enable-lora --max-loras 2`, runtime loading on):
one 2-token low-tier request leaves its adapter idle, then a high-tier tenant keeps
`--clients` requests in flight on each of two adapters for `--seconds`; per adapter: requests,
how many were answered 200 and 503, their mean latency; and the adapter loads. The high
tier's queue timeout is 20 s, as in the red team's run.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/adapter_alternate_bench.py \
        --url http://127.0.0.1:8231 --adapters DIR --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import defaultdict
from typing import Any

import aiohttp

from proxy.bench.inproc import auth, make_config, running_proxy


async def _complete(
    client: aiohttp.ClientSession, base: str, tier: str, model: str, max_tokens: int
) -> int:
    body = {"model": model, "prompt": "Tell me about tiers", "max_tokens": max_tokens}
    async with client.post(f"{base}/v1/completions", json=body, headers=auth(tier)) as resp:
        await resp.read()
        return resp.status


async def run(
    url: str, adapters_dir: str, seconds: float, max_tokens: int, clients: int
) -> dict[str, Any]:
    adapters = {
        name: {"path": f"{adapters_dir}/{src}", "base_model": "tiny", "tenants": [tenant]}
        for name, src, tenant in (
            ("a1", "tiny-lora-a", "tenant-high"),
            ("a2", "tiny-lora-b", "tenant-high"),
            ("l", "tiny-lora-c", "tenant-low"),
        )
    }
    backend = {"url": url, "max_inflight": 4, "max_loras": 2, "load_adapters": True}
    tiers = {"high": {"queue_timeout_s": 20}}
    config = make_config([backend], tiers=tiers, adapters=adapters)
    results: dict[str, list[tuple[int, float]]] = defaultdict(list)
    timeout = aiohttp.ClientTimeout(total=600)
    loads = 0.0
    async with running_proxy(config) as (base, state), aiohttp.ClientSession(timeout=timeout) as c:
        assert await _complete(c, base, "low", "l", 2) == 200
        end = time.monotonic() + seconds

        async def loop(model: str) -> None:
            while time.monotonic() < end:
                began = time.monotonic()
                status = await _complete(c, base, "high", model, max_tokens)
                results[model].append((status, time.monotonic() - began))

        await asyncio.gather(*(loop(m) for m in ("a1", "a2") for _ in range(clients)))
        for metric in state.metrics.registry.collect():
            if metric.name == "tierproxy_adapter_loads":
                loads = sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return {"loads": loads} | {
        model: {
            "requests": len(rows),
            "ok": sum(s == 200 for s, _ in rows),
            "503": sum(s == 503 for s, _ in rows),
            "mean_s": round(sum(t for _, t in rows) / len(rows), 2),
        }
        for model, rows in sorted(results.items())
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--adapters", required=True, help="tierproxy tiny-adapters DIR")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--clients", type=int, default=2, help="per adapter")
    args = parser.parse_args()
    found = run(args.url, args.adapters, args.seconds, args.max_tokens, args.clients)
    print(json.dumps(asyncio.run(found)))


if __name__ == "__main__":
    main()
