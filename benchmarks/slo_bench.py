"""Figures of docs/slo.md on real vLLM (tiny model, CPU engines confined to their cores).

    sizes     one engine per --max-num-seqs (4, 16, 64): closed-loop mixed high/normal load
              through the proxy with hand-set max_inflight values and with the adaptive room;
              throughput and the high tier's TTFT p99; the room over time (docs/img/slo-room.png)
    two       two engines of different capacity (--max-num-seqs 4 and 16) behind one proxy:
              each one's share of the work, fixed equal rooms against adaptive ones
    overload  one engine, open-loop arrivals at 2x its measured capacity, early refusal off/on:
              goodput of high and normal, and how fast the refused requests were answered

The proxy runs in this process (its state is read directly: the room over time) on the core
the engines leave free. Results go to --out as JSON.

    flock /tmp/tierproxy-engine.lock .venv/bin/python benchmarks/slo_bench.py sizes
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from proxy.bench.inproc import SECRET, auth, make_config, running_proxy
from proxy.bench.stats import percentile
from proxy.relay import sse
from proxy.ticket import DEFAULT_SECRET_ENV
from proxy.tools.engine import (
    EngineProcess,
    local_engine,
)

TIMEOUT = aiohttp.ClientTimeout(total=120)
SLO = {"high": {"ttft_s": 1.0}, "normal": {"ttft_s": 3.0}}


@contextmanager
def engines(*sizes: int) -> Iterator[list[EngineProcess]]:
    procs = [
        EngineProcess(
            local_engine(
                index=i,
                max_num_seqs=n,
                env={DEFAULT_SECRET_ENV: SECRET.decode()},  # the plugin checks the proxy's tickets
            ),
            Path(f".tierproxy/logs/slo-bench-{i}-{n}.log"),
        )
        for i, n in enumerate(sizes)
    ]
    allowed = os.sched_getaffinity(0)
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready()
        # The proxy and its clients on the core the engines leave (engine_cores()), so that
        # the kernel never puts them beside an engine; back to all cores for the next engines.
        os.sched_setaffinity(0, {max(allowed)})
        yield procs
    finally:
        os.sched_setaffinity(0, allowed)
        for p in procs:
            p.stop()


async def one_request(
    s: aiohttp.ClientSession, base: str, tier: str, max_tokens: int
) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Tell me about queues."}],
    }
    start = time.monotonic()
    out: dict[str, Any] = {"tier": tier, "start": start, "status": 0, "ttft": None, "tokens": 0}
    try:
        async with s.post(
            f"{base}/v1/chat/completions",
            json=body,
            headers={**auth(tier), "x-should-retry": "false"},
        ) as r:
            out["status"] = r.status
            if r.status != 200:
                await r.read()
            else:
                async for data in sse.data_of(r):
                    if data == sse.DONE:
                        break
                    if out["ttft"] is None and b'"content"' in data:
                        out["ttft"] = time.monotonic() - start
                    if b'"usage"' in data:
                        # Exact: under load vLLM merges several tokens into one event.
                        usage = json.loads(data).get("usage") or {}
                        out["tokens"] = usage.get("completion_tokens", out["tokens"])
    except (aiohttp.ClientError, TimeoutError) as exc:
        out["error"] = type(exc).__name__
    out["e2e"] = time.monotonic() - start
    return out


def output_tokens(rng: random.Random) -> int:
    """16-48 tokens, 32 on average: requests of one length end in lockstep and keep every
    batch in phase, which makes the closed loop's throughput depend on its start."""
    return rng.randint(16, 48)


async def closed_loop(
    base: str, clients: int, duration_s: float, high_share: float = 0.25
) -> list[dict[str, Any]]:
    stop_at = time.monotonic() + duration_s
    results: list[dict[str, Any]] = []

    async def client(i: int, tier: str) -> None:
        rng = random.Random(i)  # every setting sees the same lengths per client
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            while time.monotonic() < stop_at:
                results.append(await one_request(s, base, tier, output_tokens(rng)))

    high = max(1, round(clients * high_share))
    await asyncio.gather(*(client(i, "high" if i < high else "normal") for i in range(clients)))
    return results


def summary(results: list[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    ok = [r for r in results if r["status"] == 200]
    high = [r["ttft"] for r in ok if r["tier"] == "high" and r["ttft"] is not None]
    return {
        "rps": round(len(ok) / duration_s, 2),
        "tok_s": round(sum(r["tokens"] for r in ok) / duration_s, 1),
        "high_ttft_p50": round(percentile(high, 50), 3) if high else None,
        "high_ttft_p99": round(percentile(high, 99), 3) if high else None,
        "failed": len(results) - len(ok),
    }


def steady_window(
    results: list[dict[str, Any]], start: float, duration_s: float
) -> list[dict[str, Any]]:
    """The requests that ended inside [start, start + duration_s): a steady-state window of a
    closed loop that runs on past it (no drain at its end, no burst at its start)."""
    return [r for r in results if start <= r["start"] + r["e2e"] < start + duration_s]


def pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one setting: mean and spread of the rates; TTFT percentiles over all repeats'
    high-tier requests together."""
    tok = [r["tok_s"] for r in rows]
    high = [t for r in rows for t in r["high_ttfts"]]
    return {
        "tok_s": round(sum(tok) / len(tok), 1),
        "tok_s_min": min(tok),
        "tok_s_max": max(tok),
        "rps": round(sum(r["rps"] for r in rows) / len(rows), 2),
        "high_ttft_p50": round(percentile(high, 50), 3) if high else None,
        "high_ttft_p99": round(percentile(high, 99), 3) if high else None,
        "failed": sum(r["failed"] for r in rows),
        "repeats": len(rows),
        "vllm_running": _mean([r["vllm_running"] for r in rows if "vllm_running" in r]),
        "transit": _mean([r["transit"] for r in rows if "transit" in r]),
    }


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 1) if values else None


def proxy_cfg(urls: list[str], max_inflight: int | None, **tiers: dict[str, Any]) -> Any:
    room = {} if max_inflight is None else {"max_inflight": max_inflight}
    return make_config([{"url": u, **room} for u in urls], tiers=tiers or None)


async def watch_rooms(state: Any, stop: asyncio.Event, out: list[list[float]]) -> None:
    t0 = time.monotonic()
    while not stop.is_set():
        out.append([round(time.monotonic() - t0, 2), *(b.max_room for b in state.pool.all())])
        await asyncio.sleep(0.25)


async def watch_engine(
    state: Any, stop: asyncio.Event, out: list[tuple[float, float, float]]
) -> None:
    """Every new scrape of the (one) engine: (when, vLLM's running, requests in transit)."""
    (backend,) = state.pool.all()
    seen = None
    while not stop.is_set():
        load = backend.load
        if load is not None and load.at != seen:
            seen = load.at
            out.append((time.monotonic(), load.running, backend.in_transit(load)))
        await asyncio.sleep(0.05)


async def one_setting(
    url: str, max_inflight: int | None, clients: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One proxy, a closed loop of --warmup + --duration seconds; the rates of the requests
    that ended in the last --duration seconds, and the room over the whole run."""
    cfg = proxy_cfg([url], max_inflight)
    async with running_proxy(cfg) as (base, state):
        rooms: list[list[float]] = []
        stop = asyncio.Event()
        engine: list[tuple[float, float, float]] = []
        watchers = [
            asyncio.create_task(watch_rooms(state, stop, rooms)),
            asyncio.create_task(watch_engine(state, stop, engine)),
        ]
        t0 = time.monotonic()
        results = await closed_loop(base, clients, args.warmup + args.duration)
        stop.set()
        await asyncio.gather(*watchers)
    window = steady_window(results, t0 + args.warmup, args.duration)
    out = summary(window, args.duration)
    measured = [(running, transit) for at, running, transit in engine if at >= t0 + args.warmup]
    if measured:  # what vLLM ran and what was in its API server, mean over the window
        out["vllm_running"] = round(sum(r for r, _ in measured) / len(measured), 1)
        out["transit"] = round(sum(t for _, t in measured) / len(measured), 1)
    out["high_ttfts"] = [r["ttft"] for r in window if r["tier"] == "high" and r["ttft"] is not None]
    out["rooms"] = rooms
    return out


def room_settled_at(rooms: list[list[float]]) -> float:
    """Seconds from the load's start to the room's last change."""
    last = rooms[0][0]
    for before, now in itertools.pairwise(rooms):
        if now[1] != before[1]:
            last = now[0]
    return last


async def sizes(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting once per repeat, in a rotated order per repeat (drift of the machine
    spreads over all settings alike)."""
    table: dict[str, Any] = {}
    for n in args.sizes:
        with engines(n) as (engine,):
            clients = max(8, 2 * n + 8)
            fixed = [] if args.only_adaptive else sorted({n, n + 2, 2 * n})
            settings: list[int | None] = [*fixed, None]
            runs: dict[str, list[dict[str, Any]]] = {}
            for rep in range(args.repeats):
                shift = rep % len(settings)
                for max_inflight in settings[shift:] + settings[:shift]:
                    key = "adaptive" if max_inflight is None else f"fixed {max_inflight}"
                    run = await one_setting(engine.spec.url, max_inflight, clients, args)
                    runs.setdefault(key, []).append(run)
                    shown = {k: v for k, v in run.items() if k not in ("high_ttfts", "rooms")}
                    print(n, rep, key, shown, flush=True)
            row: dict[str, Any] = {key: pooled(rs) for key, rs in runs.items()}
            adaptive = runs["adaptive"]
            row["adaptive"]["rooms_last"] = [r["rooms"][-1][1] for r in adaptive]
            row["adaptive"]["settled_s"] = [room_settled_at(r["rooms"]) for r in adaptive]
            row["rooms"] = adaptive[-1]["rooms"]
            best = max((v["tok_s"] for k, v in row.items() if k.startswith("fixed")), default=0)
            if best:
                row["adaptive"]["of_best_fixed"] = round(row["adaptive"]["tok_s"] / best, 3)
            print(n, {k: v for k, v in row.items() if k != "rooms"}, flush=True)
            table[str(n)] = row
    return table


async def two(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with engines(4, 16) as procs:
        urls = [p.spec.url for p in procs]
        for max_inflight in (8, None):
            cfg = proxy_cfg(urls, max_inflight)
            async with running_proxy(cfg) as (base, state):
                await closed_loop(base, 40, 2.0)
                before = {b.cfg.url: b.dispatched_total for b in state.pool.all()}
                rooms: list[list[float]] = []
                stop = asyncio.Event()
                watcher = asyncio.create_task(watch_rooms(state, stop, rooms))
                results = await closed_loop(base, 40, args.duration)
                stop.set()
                await watcher
                done = {b.cfg.url: b.dispatched_total - before[b.cfg.url] for b in state.pool.all()}
            key = "adaptive" if max_inflight is None else f"fixed {max_inflight} each"
            total = sum(done.values()) or 1
            out[key] = {
                **summary(results, args.duration),
                "share_seqs4": round(done[urls[0]] / total, 3),
                "share_seqs16": round(done[urls[1]] / total, 3),
                "rooms_last": rooms[-1][1:],
            }
            print(key, out[key], flush=True)
    return out


async def open_loop(base: str, rate: float, duration_s: float, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    tasks: list[asyncio.Task[dict[str, Any]]] = []
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=aiohttp.TCPConnector(limit=0)) as s:
        t = time.monotonic()
        stop_at = t + duration_s
        while t < stop_at:
            tier = "high" if rng.random() < 0.25 else "normal"
            tasks.append(asyncio.create_task(one_request(s, base, tier, output_tokens(rng))))
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t - time.monotonic()))
        return list(await asyncio.gather(*tasks))


async def overload(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tiers = {
        "high": {"queue_timeout_s": 2.0, "slo": SLO["high"]},
        "normal": {"queue_timeout_s": 4.0, "slo": SLO["normal"]},
    }
    with engines(4) as (engine,):
        cfg = proxy_cfg([engine.spec.url], 6, **tiers)
        async with running_proxy(cfg) as (base, _):
            capacity = summary(await closed_loop(base, 12, 5.0), 5.0)["rps"]
        out["capacity_rps"] = capacity
        for early in (False, True):
            tiers_now = {name: {**t, "early_refusal": early} for name, t in tiers.items()}
            cfg = proxy_cfg([engine.spec.url], 6, **tiers_now)
            async with running_proxy(cfg) as (base, _):
                results = await open_loop(base, 2 * capacity, args.duration, seed=7)
            row: dict[str, Any] = {"sent": len(results)}
            for tier in ("high", "normal"):
                mine = [r for r in results if r["tier"] == tier]
                met = [
                    r
                    for r in mine
                    if r["status"] == 200
                    and r["ttft"] is not None
                    and r["ttft"] <= SLO[tier]["ttft_s"]
                ]
                row[f"{tier}_goodput"] = round(len(met) / max(1, len(mine)), 3)
                row[f"{tier}_goodput_rps"] = round(len(met) / args.duration, 2)
            for status in (429, 503):
                lat = sorted(r["e2e"] for r in results if r["status"] == status)
                row[f"n_{status}"] = len(lat)
                if lat:
                    row[f"p50_{status}_s"] = round(percentile(lat, 50), 4)
                    row[f"p99_{status}_s"] = round(percentile(lat, 99), 4)
                row[f"latencies_{status}"] = [round(x, 4) for x in lat]
            key = "early refusal on" if early else "early refusal off"
            out[key] = row
            print(key, {k: v for k, v in row.items() if not k.startswith("lat")}, flush=True)
    return out


def plot(args: argparse.Namespace) -> None:
    """docs/img/slo-room.png: the adaptive room over time under constant load, per engine size
    (from sizes.json), and the latencies of refused answers (from overload.json)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads((args.out / "sizes.json").read_text())
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for n, row in data.items():
        t = [p[0] for p in row["rooms"]]
        ax.step(t, [p[1] for p in row["rooms"]], where="post", label=f"--max-num-seqs {n}")
    ax.set_xlabel("seconds of constant load (warm-up included)")
    ax.set_ylabel("room (requests)")
    ax.set_yscale("log", base=2)
    ax.set_title("Adaptive room, max_inflight unset")
    ax.legend()
    fig.tight_layout()
    fig.savefig("docs/img/slo-room.png", dpi=110)
    over = args.out / "overload.json"
    if over.exists():
        runs = json.loads(over.read_text())
        fig, ax = plt.subplots(figsize=(7, 3.2))
        for key in ("early refusal off", "early refusal on"):
            for status in (429, 503):
                lat = runs[key].get(f"latencies_{status}", [])
                if lat:
                    ys = [(i + 1) / len(lat) for i in range(len(lat))]
                    ax.step(lat, ys, where="post", label=f"{key}: {status} ({len(lat)})")
        ax.set_xscale("log")
        ax.set_xlabel("seconds until the refusal reached the client")
        ax.set_ylabel("share of refused")
        ax.set_title("overload 2x: latency of refused requests")
        ax.legend()
        fig.tight_layout()
        fig.savefig("docs/img/slo-refusals.png", dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=["sizes", "two", "overload", "all", "plot"])
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--duration", type=float, default=8.0, help="seconds measured per run")
    p.add_argument(
        "--warmup", type=float, default=6.0, help="sizes: seconds of load before the window"
    )
    p.add_argument("--repeats", type=int, default=1, help="sizes: runs of every setting")
    p.add_argument("--only-adaptive", action="store_true", help="sizes: skip the fixed rooms")
    p.add_argument("--out", type=Path, default=Path(".tierproxy/slo-bench"))
    args = p.parse_args()
    if args.what == "plot":
        plot(args)
        return 0
    runs = {"sizes": sizes, "overload": overload, "two": two}
    for what in runs if args.what == "all" else [args.what]:  # "all": under one engine lock
        result = asyncio.run(runs[what](args))
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{what}.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
