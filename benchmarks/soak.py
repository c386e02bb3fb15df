"""A soak: mixed tiers, streams and client hang-ups through the proxy in front of a real vLLM,
watching the proxy process for leaks.

    python benchmarks/soak.py [--minutes 10] [--clients 6] [--warmup-s 60]

Starts one confined CPU vLLM with the tiny model and the proxy as `tierproxy serve` in its own
process, then runs ``--clients`` clients back to back for ``--minutes``: each request picks a
tier (high, normal, low) and a kind: streamed and read to the end, not streamed, streamed and
hung up after the first events, or hung up before any answer (while queued or prefilling).
Prints the proxy's RSS, open file descriptors and asyncio task count at the start, after the
warm-up, every minute and at the end (after the load stopped and the proxy went idle).
Aims: RSS grows < 5 % after the warm-up; fds and tasks go back to their values at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from proxy.bench.live import (
    LiveStack,
    ProxyUsage,
    auth,
    base_config,
    chat_body,
    open_sockets,
    proxy_usage,
)
from proxy.server.open_files import raise_open_files_limit

TIERS = ("high", "normal", "low")
KINDS = ("stream", "whole", "hang up mid-stream", "hang up before the answer")
WEIGHTS = (4, 3, 2, 1)
TIMEOUT = aiohttp.ClientTimeout(total=120)


async def one_request(
    http: aiohttp.ClientSession, stack: LiveStack, rng: random.Random
) -> tuple[str, str]:
    """(kind, outcome) of one request."""
    tier, kind = rng.choice(TIERS), rng.choices(KINDS, WEIGHTS)[0]
    stream = kind != "whole"
    body = chat_body(stack.model, rng.randint(4, 48), stream=stream)
    url = f"{stack.url}/v1/chat/completions"
    if kind == "hang up before the answer":
        task = asyncio.create_task(_post(http, url, body, tier))
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return kind, "hung up"
        return kind, "answered first"
    async with http.post(url, json=body, headers=auth(tier), timeout=TIMEOUT) as resp:
        if kind == "hang up mid-stream" and resp.status == 200:
            events = 0
            async for line in resp.content:
                events += line.startswith(b"data:")
                if events >= 2:
                    break
            resp.close()  # drops the connection: the proxy sees the client leave
            return kind, "hung up"
        await resp.read()
        return kind, str(resp.status)


async def _post(
    http: aiohttp.ClientSession,
    url: str,
    body: object,
    tier: str,
) -> None:
    async with http.post(url, json=body, headers=auth(tier), timeout=TIMEOUT) as resp:
        await resp.read()


async def client(
    http: aiohttp.ClientSession,
    stack: LiveStack,
    seed: int,
    until: float,
    outcomes: collections.Counter[str],
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        try:
            kind, outcome = await one_request(http, stack, rng)
        except (aiohttp.ClientError, TimeoutError) as exc:
            kind, outcome = "error", type(exc).__name__
        outcomes[f"{kind}: {outcome}"] += 1


async def settle(
    http: aiohttp.ClientSession, stack: LiveStack, idle: ProxyUsage | None = None
) -> ProxyUsage:
    """The proxy's usage once it holds no slot and its tasks and fds are back to ``idle``'s
    (without ``idle``: stayed the same for a second), 30 s at most."""
    started = time.monotonic()
    usage = now = await proxy_usage(http, stack)
    while time.monotonic() - started < 30.0:
        await asyncio.sleep(1.0)
        now = await proxy_usage(http, stack)
        target = idle or usage
        if now.inflight == 0 and now.tasks <= target.tasks and now.open_fds <= target.open_fds:
            break
        usage = now
    print(f"  (settled after {time.monotonic() - started:.0f} s)")
    return now


async def run(args: argparse.Namespace, out_dir: Path) -> None:
    with LiveStack(out_dir) as stack:
        stack.start(base_config())
        async with (
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=False)
            ) as http,
            aiohttp.ClientSession() as probe,
        ):
            start = await settle(probe, stack)
            assert stack.engine is not None
            ports = end_port(stack.url), stack.engine.spec.port
            print(start.line("start (idle)"), flush=True)
            print(f"  the proxy's TCP sockets: {open_sockets(stack.proxy_pid, *ports)}")
            outcomes: collections.Counter[str] = collections.Counter()
            began = time.monotonic()
            until = began + args.minutes * 60
            clients = [
                asyncio.create_task(client(http, stack, seed, until, outcomes))
                for seed in range(args.clients)
            ]
            await asyncio.sleep(args.warmup_s)
            warm = await proxy_usage(probe, stack)
            print(warm.line(f"after warm-up {args.warmup_s:g} s"), flush=True)
            while (left := until - time.monotonic()) > 0:
                await asyncio.sleep(min(60.0, left))
                minute = (time.monotonic() - began) / 60
                print((await proxy_usage(probe, stack)).line(f"  at {minute:.1f} min"), flush=True)
            await asyncio.gather(*clients)
        async with aiohttp.ClientSession() as probe:
            end = await settle(probe, stack, start)
            sockets = open_sockets(stack.proxy_pid, *ports)
        print(end.line("end (idle again)"))
        print(f"  the proxy's TCP sockets at the end: {sockets}")
        growth = (end.rss_bytes - warm.rss_bytes) / warm.rss_bytes * 100
        print(f"RSS growth after warm-up: {growth:+.1f} % (aim < 5 %)")
        print(
            f"open fds: start {start.open_fds}, end {end.open_fds};"
            f" event-loop tasks: start {start.tasks}, end {end.tasks}"
        )
        print(f"requests: {sum(outcomes.values())} in {args.minutes:g} min")
        for name, count in sorted(outcomes.items()):
            print(f"  {name:40} {count}")


def end_port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the load runs (10)")
    parser.add_argument("--clients", type=int, default=6, help="clients back to back (6)")
    parser.add_argument("--warmup-s", type=float, default=60.0, help="warm-up (60 s)")
    parser.add_argument("--out", type=Path, help="where logs go (a temporary folder)")
    args = parser.parse_args()
    if args.warmup_s >= args.minutes * 60:
        parser.error("--warmup-s must be shorter than the run")
    raise_open_files_limit()
    print(f"soak: {args.minutes:g} min, {args.clients} clients", file=sys.stderr)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        asyncio.run(run(args, args.out))
        return
    with tempfile.TemporaryDirectory() as out:
        asyncio.run(run(args, Path(out)))


if __name__ == "__main__":
    main()
