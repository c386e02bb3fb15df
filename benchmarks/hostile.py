"""Hostile clients against the proxy in front of a real vLLM (issue #12's figures).

    python benchmarks/hostile.py [--idle 1000] [--slowloris 200] [--requests 60] [--flood 200]

Starts one confined CPU vLLM with the tiny model and the proxy as `tierproxy serve` in its own
process (its RSS is its own), then prints:
  (c) high-tier TTFT (streamed) through the proxy, quiet and again while another process holds
      ``--idle`` idle connections and ``--slowloris`` slowloris clients open (reopening each one
      the proxy closes); the ratio of the p99s (aim: <= 1.5);
  (a) backend slots still held by clients that stopped reading their stream, after the tier's
      request_timeout_s + relay.send_idle_timeout_s (expected: 0);
  (b) the proxy's RSS under a flood of maximal bodies (limits.max_body_bytes) against a small
      memory budget (limits.max_held_bytes): peak RSS, the budget, refusals, status histogram.
Raises its own open-files limit; every process and socket it opens is closed on the way out.

    python benchmarks/hostile.py --served-rows [--header-conns 1000] [--budget-conns 4096]

runs only the rows against `tierproxy serve` (uvloop, C parser) in front of a fake backend (no
vLLM; tests/adversarial/served): (d) RSS over idle per 1,000 connections that send headers
without the blank line that ends them (the issue's 127 x 8,000 bytes; then heads under
server.max_header_bytes, at the default 4,096 connections); (e) a flood past the connection
cap: 503s answered and log lines per refused connection.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from proxy.bench.hostile.kit import unfinished_headers
from proxy.bench.hostile.measure import header_memory, hostile_head, over_cap
from proxy.bench.hostile.served import NullBackend, ServedProxy, served_config
from proxy.bench.live import (
    LiveStack,
    auth,
    base_config,
    chat_body,
    proxy_usage,
    rss_bytes,
    stream_ttft,
)
from proxy.bench.proxy_config import BENCH_ADMIN_KEY
from proxy.bench.scrape import fetch_metrics
from proxy.server.open_files import raise_open_files_limit
from proxy.telemetry.prometheus import VLLM_RUNNING, total

LOW_TIMEOUT_S = 4.0  # the low tier's request_timeout_s
SEND_IDLE_S = 2.0  # relay.send_idle_timeout_s
MAX_BODY = 1024 * 1024  # limits.max_body_bytes


def config(budget_bytes: int) -> dict[str, Any]:
    return base_config(
        tiers={"low": {"request_timeout_s": LOW_TIMEOUT_S, "queue_timeout_s": 30}},
        limits={"max_body_bytes": MAX_BODY, "max_held_bytes": budget_bytes},
        relay={"send_idle_timeout_s": SEND_IDLE_S},
    )


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


# -- (c) TTFT, quiet and under idle + slowloris connections --------------------------------------
async def ttft_run(
    http: aiohttp.ClientSession, stack: LiveStack, requests: int, label: str
) -> float:
    ttfts: list[float] = []
    statuses: collections.Counter[int] = collections.Counter()
    pending = iter(range(requests))

    async def worker() -> None:
        for _ in pending:
            status, first = await stream_ttft(http, stack.url, "high", chat_body(stack.model, 16))
            statuses[status] += 1
            if first is not None:
                ttfts.append(first)

    await asyncio.gather(*(worker() for _ in range(2)))
    if not ttfts:
        raise RuntimeError(f"{label}: no request streamed a token ({dict(statuses)})")
    print(
        f"  {label:34} n {len(ttfts):4d}  p50 {statistics.median(ttfts) * 1e3:7.1f} ms"
        f"  p99 {p99(ttfts) * 1e3:7.1f} ms  statuses {dict(statuses)}"
    )
    return p99(ttfts)


class Attacker:
    """This script with --attack in a child process: it holds the connections."""

    def __init__(self, url: str, idle: int, slowloris: int) -> None:
        cmd = [sys.executable, __file__, "--attack", url, str(idle), str(slowloris)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("ready"):
                return line.strip()
            if not line and self.proc.poll() is not None:
                raise RuntimeError("the attacker exited before it was ready")
        raise RuntimeError("the attacker did not open its connections in time")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out.strip().splitlines()[-1] if out.strip() else ""


async def attack(url: str, idle: int, slowloris: int) -> None:
    """Hold ``idle`` connections that send nothing and ``slowloris`` ones that send a header
    line a second; reopen each one the server closes, until SIGTERM."""
    raise_open_files_limit()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    counts = collections.Counter[str]()
    all_open = asyncio.Event()
    opened = asyncio.Semaphore(100)  # connect in waves, as a real flood would not bother to

    async def hold(slow: bool) -> None:
        while not stop.is_set():
            try:
                async with opened:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(host, int(port)), 10
                    )
                counts["opened"] += 1
                if counts["opened"] >= idle + slowloris:
                    all_open.set()
            except (OSError, TimeoutError):
                counts["connect failed"] += 1
                await asyncio.sleep(0.5)
                continue
            try:
                if slow:
                    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
                while not stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        if not await asyncio.wait_for(reader.read(65536), 1.0):
                            counts["closed by the proxy"] += 1
                            break
                    if slow:
                        writer.write(b"X-Slow: 1\r\n")
            except OSError:
                counts["closed by the proxy"] += 1
            finally:
                writer.close()

    tasks = [asyncio.create_task(hold(i < slowloris)) for i in range(idle + slowloris)]
    await asyncio.wait_for(all_open.wait(), 120)
    print(f"ready: {counts['opened']} connections open", flush=True)
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    print(", ".join(f"{k} {v}" for k, v in sorted(counts.items())), flush=True)


# -- (a) clients that stop reading ---------------------------------------------------------------
async def non_readers(http: aiohttp.ClientSession, stack: LiveStack, clients: int) -> None:
    body = chat_body(stack.model, 1500, stream=True, ignore_eos=True)
    payload = json.dumps(body).encode()
    host, port = stack.url.removeprefix("http://").rsplit(":", 1)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: {auth('low')['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    socks = []
    try:
        for _ in range(clients):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
            sock.settimeout(5)
            sock.connect((host, int(port)))
            sock.sendall(head + payload)
            socks.append(sock)
        started = time.monotonic()
        held_early = 0
        while time.monotonic() - started < 3.0:  # until they hold their slots
            held_early = (await proxy_usage(http, stack)).inflight
            if held_early >= clients:
                break
            await asyncio.sleep(0.2)
        deadline = LOW_TIMEOUT_S + SEND_IDLE_S
        await asyncio.sleep(max(0.0, started + deadline + 1.0 - time.monotonic()))
        held = (await proxy_usage(http, stack)).inflight
        vllm = await fetch_metrics(http, stack.engine_url)
        running = total(vllm, VLLM_RUNNING) if vllm else float("nan")
        print(
            f"  {clients} low-tier streams never read: slots held {held_early} while running;"
            f" {held} held {time.monotonic() - started:.1f} s after sending (deadline"
            f" {LOW_TIMEOUT_S:g} s + send-idle {SEND_IDLE_S:g} s); vLLM running {running:g}"
        )
    finally:
        for sock in socks:
            sock.close()


# -- (b) a flood of maximal bodies ---------------------------------------------------------------
async def flood(
    http: aiohttp.ClientSession, stack: LiveStack, count: int, budget: int, concurrency: int = 64
) -> None:
    filler = "x" * (MAX_BODY - 200)
    body = chat_body(stack.model, 1, filler)
    statuses: collections.Counter[str] = collections.Counter()
    pid = stack.proxy_pid
    idle_rss = rss_bytes(pid)
    peak = idle_rss
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_bytes(pid))
            await asyncio.sleep(0.02)

    async def one() -> None:
        async with http.post(
            f"{stack.url}/v1/chat/completions",
            json=body,
            headers=auth("low"),
            timeout=aiohttp.ClientTimeout(total=120),
        ) as resp:
            data = await resp.json(content_type=None)
            code = (data.get("error") or {}).get("code") if isinstance(data, dict) else None
            label = f"{resp.status} {code}" if isinstance(code, str) else str(resp.status)
            statuses[label] += 1

    gate = asyncio.Semaphore(concurrency)

    async def gated() -> None:
        async with gate:
            await one()

    sampler = asyncio.create_task(sample())
    started = time.monotonic()
    try:
        await asyncio.gather(*(gated() for _ in range(count)))
    finally:
        done.set()
        await sampler
    refused = sum(v for k, v in statuses.items() if "proxy_memory_full" in k)
    hwm = rss_bytes(pid, "VmHWM")
    print(
        f"  {count} bodies of {MAX_BODY / 2**20:.0f} MiB, {concurrency} at a time,"
        f" {time.monotonic() - started:.1f} s: RSS idle {idle_rss / 2**20:.0f} MiB,"
        f" peak {peak / 2**20:.0f} MiB (sampled every 20 ms; VmHWM {hwm / 2**20:.0f} MiB),"
        f" growth {(peak - idle_rss) / 2**20:.0f} MiB vs budget {budget / 2**20:.0f} MiB"
    )
    print(f"  refused at the budget (503 proxy_memory_full): {refused}")
    print(f"  statuses: {dict(sorted(statuses.items()))}")


async def run(args: argparse.Namespace, out_dir: Path) -> None:
    budget = args.budget_mib * 2**20
    with LiveStack(out_dir) as stack:
        stack.start(config(budget))
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            for _ in range(4):  # warm-up
                await stream_ttft(http, stack.url, "high", chat_body(stack.model, 16))
            print((await proxy_usage(http, stack)).line("proxy at rest"))
            print("(c) high-tier TTFT through the proxy, 2 clients, 16 tokens, streamed")
            quiet = await ttft_run(http, stack, args.requests, "quiet")
            attacker = Attacker(stack.url, args.idle, args.slowloris)
            try:
                ready = attacker.wait_ready()
                # Into the time when the proxy's header/idle timeouts close the attackers'
                # connections and they reconnect (server.header_timeout_s: 10 s).
                await asyncio.sleep(args.attack_warmup_s)
                usage = await proxy_usage(http, stack)
                text = await fetch_metrics(http, stack.url, key=BENCH_ADMIN_KEY) or ""
                print(
                    f"  attacker {ready}; the proxy counts"
                    f" {total(text, 'tierproxy_open_connections'):g} open,"
                    f" {usage.open_fds} fds"
                )
                busy = await ttft_run(
                    http, stack, args.requests, f"{args.idle} idle + {args.slowloris} slowloris"
                )
            finally:
                print(f"  attacker: {attacker.stop()}")
            print(f"  p99 ratio under attack / quiet: {busy / quiet:.2f} (aim <= 1.5)")
            print("(a) clients that stop reading")
            await non_readers(http, stack, 4)
            print("(b) memory under a flood of maximal bodies")
            await flood(http, stack, args.flood, budget)
            await asyncio.sleep(1.0)
            print((await proxy_usage(http, stack)).line("proxy at the end"))


# -- (d), (e) against the served process, in front of a fake backend ---------------------------
async def served_rows(args: argparse.Namespace, out_dir: Path) -> None:
    with NullBackend().start() as backend:
        caps = {"max_connections": args.budget_conns + 100}
        print("(d) unfinished request heads (tierproxy serve, uvloop, C parser)")
        for name, conns, head in (
            ("1 MiB heads", args.header_conns, unfinished_headers()),
            ("31 KiB heads", args.budget_conns, hostile_head(31 * 1024)),
        ):
            proxy = ServedProxy(served_config(backend.url, server=caps), out_dir, name=name[:5])
            with proxy.start():
                figures = await header_memory(proxy, conns, head)
            print(f"  {figures.line()}")
        print("(e) a flood past the connection cap")
        cap = 100
        config = served_config(backend.url, server={"max_connections": cap})
        with ServedProxy(config, out_dir, name="cap").start() as proxy:
            print(f"  cap {cap}: {(await over_cap(proxy, cap, args.flood_conns)).line()}")


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--attack":
        asyncio.run(attack(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--idle", type=int, default=1000, help="idle connections (1000)")
    parser.add_argument("--slowloris", type=int, default=200, help="slowloris clients (200)")
    parser.add_argument("--requests", type=int, default=100, help="TTFT requests per phase (100)")
    parser.add_argument(
        "--attack-warmup-s", type=float, default=8.0, help="attack before measuring (8 s)"
    )
    parser.add_argument("--flood", type=int, default=200, help="maximal bodies sent (200)")
    parser.add_argument("--budget-mib", type=int, default=32, help="limits.max_held_bytes (32)")
    parser.add_argument("--out", type=Path, help="where logs go (a temporary folder)")
    parser.add_argument(
        "--served-rows", action="store_true", help="only (d) and (e): served proxy, fake backend"
    )
    parser.add_argument("--header-conns", type=int, default=1000, help="(d) 1 MiB heads (1000)")
    parser.add_argument("--budget-conns", type=int, default=4096, help="(d) 31 KiB heads (4096)")
    parser.add_argument("--flood-conns", type=int, default=1000, help="(e) over the cap (1000)")
    args = parser.parse_args()
    soft, hard = raise_open_files_limit()
    print(f"open-files limit of this process: {soft} (hard {hard})")
    if args.served_rows:
        with tempfile.TemporaryDirectory() as out:
            asyncio.run(served_rows(args, args.out or Path(out)))
        return
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        asyncio.run(run(args, args.out))
        return
    with tempfile.TemporaryDirectory() as out:
        asyncio.run(run(args, Path(out)))


if __name__ == "__main__":
    main()
