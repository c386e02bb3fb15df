"""Six tenants, each with its own LoRA adapter, over two CPU engines with --max-loras 2:
adapter-aware routing (``adapters:`` with max_loras and runtime loading) against adapter-blind
``least_utilised`` (the engines list all six adapters, the proxy knows nothing of them).

Both engines start with the six tiny adapters (``--lora-modules``) and runtime loading on;
before each blind run every adapter is loaded on both; before each aware run none is (the proxy
loads them on demand, at most two per engine, unloading the least recently used idle one).
Each tenant (two per tier) runs a closed loop of ``--clients`` streaming requests of
``--max-tokens`` output tokens for ``--duration`` seconds. Printed per mode: adapter loads by
the proxy, requests that waited over ``--deferred-s`` inside vLLM's scheduler (its queue-time
histogram: an adapter with no free slot is "deferred" there), TTFT p50/p95 per tier, output
tokens/s. ``--modes aware-strict,aware`` compares adapter-aware routing with strict tier order
for slots (``due_share: 1``) and without; ``aware-no-wait`` has ``locality_wait_s: 0``
(docs/adapters.md). ``--plot`` draws docs/img/adapters-bench.png's figure
(``proxy.bench.adapterplots``);
``--replot RESULTS.json`` redraws it from a stored ``--out`` without starting engines.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/adapters_bench.py --duration 30 \
        --out results.json --plot docs/img/adapters-bench.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from proxy.bench.adapterplots import adapter_figure
from proxy.bench.inproc import SECRET, make_config, running_proxy
from proxy.config.tenants import hash_key
from proxy.ticket import DEFAULT_SECRET_ENV
from proxy.tools.engine import EngineProcess, local_engine
from proxy.tools.tiny_adapters import LORA_CPU_ARGS, make_tiny_adapters

TIERS = ("high", "high", "normal", "normal", "low", "low")
BLIND = "least_utilised (adapter-blind)"
AWARE_NO_WAIT = "adapter-aware, locality_wait_s 0"  # wanted adapters given up in queue order
AWARE_STRICT = "adapter-aware, due_share 1"  # strict tier order for adapter slots
AWARE_KNOBS = {AWARE_NO_WAIT: {"locality_wait_s": 0}, AWARE_STRICT: {"due_share": 1}}
MODES = {
    "blind": BLIND,
    "aware": "adapter-aware",
    "aware-no-wait": AWARE_NO_WAIT,
    "aware-strict": AWARE_STRICT,
}
NAMES = tuple(f"lora-{i}" for i in range(len(TIERS)))
_BUCKET = re.compile(
    r'^vllm:request_queue_time_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)$', re.MULTILINE
)


def _tenants() -> list[dict[str, Any]]:
    return [
        {"name": f"tenant-{i}", "tier": tier, "keys": [{"sha256": hash_key(f"key-{i}")}]}
        for i, tier in enumerate(TIERS)
    ]


async def _queue_buckets(session: aiohttp.ClientSession, url: str) -> dict[float, float]:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return {float(le): float(n) for le, n in _BUCKET.findall(text)}


async def _deferred(
    session: aiohttp.ClientSession, urls: list[str], before: list[dict[float, float]], bound: float
) -> float:
    total = 0.0
    for url, old in zip(urls, before, strict=True):
        new = await _queue_buckets(session, url)
        inf = float("inf")
        total += (new[inf] - old.get(inf, 0.0)) - (new[bound] - old.get(bound, 0.0))
    return total


async def _reload_all(
    session: aiohttp.ClientSession, urls: list[str], dirs: dict[str, Path]
) -> None:
    for url in urls:
        for name, path in dirs.items():
            body = {"lora_name": name, "lora_path": str(path)}
            async with session.post(f"{url}/v1/load_lora_adapter", json=body) as resp:
                assert resp.status in (200, 400), await resp.text()


async def _unload_all(session: aiohttp.ClientSession, urls: list[str]) -> None:
    for url in urls:
        for name in NAMES:
            body = {"lora_name": name}
            async with session.post(f"{url}/v1/unload_lora_adapter", json=body) as resp:
                assert resp.status in (200, 404), await resp.text()


async def _client(
    session: aiohttp.ClientSession,
    base: str,
    i: int,
    args: argparse.Namespace,
    end: float,
    ttfts: list[float],
    tokens: list[int],
) -> None:
    loop = asyncio.get_running_loop()
    body = {
        "model": NAMES[i],
        "prompt": f"tenant {i} asks " + "why " * 40,
        "stream": True,
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer key-{i}"}
    while loop.time() < end:
        started, first = loop.time(), None
        async with session.post(f"{base}/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                print("refused:", resp.status, (await resp.text())[:200])
                await asyncio.sleep(0.5)
                continue
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[6:])
                if first is None and event.get("choices"):
                    first = loop.time() - started
                if event.get("usage"):
                    tokens.append(int(event["usage"]["completion_tokens"]))
        if first is not None:
            ttfts.append(first)


async def _run(
    mode: str, urls: list[str], dirs: dict[str, Path], args: argparse.Namespace
) -> dict[str, Any]:
    aware = mode != BLIND
    # Blind: the engines hold every adapter and the proxy counts no slot (max_loras far above
    # the engines' 2, nothing loaded by it), so least_utilised sends any adapter anywhere. The
    # catalogue is there in both modes: an adapter it does not name is nobody's.
    slots = {"max_loras": 2, "load_adapters": True} if aware else {"max_loras": 64}
    backends = [{"url": u, "max_inflight": args.max_num_seqs} | slots for u in urls]
    extra: dict[str, Any] = {
        "adapters": {
            name: {"path": str(dirs[name]), "base_model": "tiny", "tenants": [f"tenant-{i}"]}
            for i, name in enumerate(NAMES)
        }
    }
    if mode in AWARE_KNOBS:
        extra["scheduling"] = {"adapter_slots": AWARE_KNOBS[mode]}
    config = make_config(backends, tenants=_tenants(), **extra)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        if aware:  # the proxy loads each adapter where and when it is needed
            await _unload_all(session, urls)
        else:  # every adapter on both engines: the blind chooser may send any anywhere
            await _reload_all(session, urls, dirs)
        async with running_proxy(config) as (base, state):
            await asyncio.sleep(1.0)  # its first /v1/models probes
            before = [await _queue_buckets(session, u) for u in urls]
            loop = asyncio.get_running_loop()
            end = loop.time() + args.duration
            ttfts: dict[int, list[float]] = {i: [] for i in range(len(TIERS))}
            tokens: list[int] = []
            started = loop.time()
            await asyncio.gather(
                *(
                    _client(session, base, i, args, end, ttfts[i], tokens)
                    for i in range(len(TIERS))
                    for _ in range(args.clients)
                )
            )
            elapsed = loop.time() - started
            deferred = await _deferred(session, urls, before, args.deferred_s)
            m = state.metrics.adapters
            loads = sum(m.loads.labels(u, n)._value.get() for u in urls for n in NAMES)
    by_tier: dict[str, list[float]] = {}
    for i, tier in enumerate(TIERS):
        by_tier.setdefault(tier, []).extend(ttfts[i])
    return {
        "mode": mode,
        "requests": sum(len(v) for v in ttfts.values()),
        "adapter_loads": loads,
        "waited_in_vllm": deferred,  # over waited_over_s in vLLM's scheduler
        "waited_over_s": args.deferred_s,
        "output_tokens_per_s": round(sum(tokens) / elapsed, 1),
        "ttft_s": {
            tier: {
                "p50": round(statistics.median(v), 3),
                "p95": round(statistics.quantiles(v, n=20)[-1], 3) if len(v) > 1 else None,
            }
            for tier, v in by_tier.items()
            if v
        },
        "ttfts": {tier: [round(t, 4) for t in v] for tier, v in by_tier.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=1, help="concurrent requests per tenant")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--deferred-s", type=float, default=0.5, help="a vLLM histogram bucket")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--ready-s", type=float, default=600.0, help="each engine's start (two share a core)"
    )
    parser.add_argument(
        "--modes",
        default="blind,aware",
        help="comma-separated, of: " + ", ".join(MODES),
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, help="draw the figure (PNG) here")
    parser.add_argument("--replot", type=Path, help="only redraw --plot from this --out file")
    args = parser.parse_args()
    if args.replot is not None:
        adapter_figure(json.loads(args.replot.read_text()), args.plot or Path("adapters.png"))
        return 0
    dirs = make_tiny_adapters(
        Path(tempfile.mkdtemp(prefix="adapters-")), ".tierproxy/tiny-model", names=NAMES
    )
    modules = [f"{n}={p}" for n, p in dirs.items()]
    lora: tuple[str, ...] = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")
    lora += (*LORA_CPU_ARGS, "--lora-modules", *modules)
    engines = [
        EngineProcess(
            local_engine(
                index=i,
                max_num_seqs=args.max_num_seqs,
                extra_args=lora,
                env={
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                    DEFAULT_SECRET_ENV: SECRET.decode(),
                },
            ),
            Path(f".tierproxy/logs/adapters-bench-{i}.log"),
        )
        for i in range(2)
    ]
    results: list[dict[str, Any]] = []
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready(timeout_s=args.ready_s)
        urls = [e.spec.url for e in engines]
        for _ in range(args.rounds):
            for mode in (MODES[m] for m in args.modes.split(",")):
                result = asyncio.run(_run(mode, urls, dirs, args))
                print(json.dumps({k: v for k, v in result.items() if k != "ttfts"}), flush=True)
                results.append(result)
    finally:
        for e in engines:
            e.stop()
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    if args.plot is not None:
        adapter_figure(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
