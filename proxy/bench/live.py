"""The proxy (`tierproxy serve`, its own process) in front of one real confined CPU vLLM with
the tiny model, for the hostile-client and soak benchmarks; plus what they read of it: the
proxy process's RSS, open files and event-loop tasks, and a streamed request's TTFT.
"""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from proxy.bench.inproc import KEYS, auth, make_config
from proxy.bench.proxy_config import BENCH_ADMIN_KEY
from proxy.bench.scrape import fetch_metrics
from proxy.bench.stack import ProxyProcess
from proxy.config.tenants import hash_key
from proxy.ops.process import StopOnExit, free_port
from proxy.telemetry.prometheus import total
from proxy.ticket import DEFAULT_SECRET_ENV
from proxy.tools.engine import EngineProcess, local_engine

__all__ = ["KEYS", "LiveStack", "ProxyUsage", "auth", "chat_body", "stream_ttft"]


class LiveStack(StopOnExit):
    """vLLM (``max_num_seqs`` slots, cores but the last) and the proxy on ``config`` (a mapping
    like ``make_config``'s, its backend filled in here); the proxy gets this checkout's code."""

    def __init__(self, out_dir: Path, max_num_seqs: int = 4) -> None:
        self.out_dir = out_dir
        self.max_num_seqs = max_num_seqs
        self.engine: EngineProcess | None = None
        self.proxy: ProxyProcess | None = None
        self.model = ""

    def start(self, proxy_config: dict[str, Any]) -> LiveStack:
        secret = os.environ.get(DEFAULT_SECRET_ENV) or secrets.token_urlsafe(32)
        spec = local_engine(max_num_seqs=self.max_num_seqs, env={DEFAULT_SECRET_ENV: secret})
        self.model = spec.served_name or spec.model
        self.engine = EngineProcess(spec, self.out_dir / "vllm.log")
        print(f"starting vLLM on {spec.url} (log {self.engine.log_path})", file=sys.stderr)
        self.engine.start().wait_ready(300.0)
        port = free_port()
        backend = {"url": spec.url, "max_inflight": self.max_num_seqs}
        config = {**proxy_config, "backends": [backend]}
        config["listen"] = {"host": "127.0.0.1", "port": port}
        path = self.out_dir / "proxy.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        env = {DEFAULT_SECRET_ENV: secret, "PYTHONPATH": _checkout_path()}
        self.proxy = ProxyProcess(path, port, self.out_dir / "proxy.log", env=env)
        print(
            f"starting the proxy on {self.proxy.url} (log {self.proxy.log_path})", file=sys.stderr
        )
        self.proxy.start()
        return self

    @property
    def url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    @property
    def engine_url(self) -> str:
        assert self.engine is not None
        return self.engine.spec.url

    @property
    def proxy_pid(self) -> int:
        assert self.proxy is not None and self.proxy.pid is not None
        return self.proxy.pid

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        if self.engine is not None:
            self.engine.stop()
            self.engine = None


def _checkout_path() -> str:
    here = str(Path(__file__).resolve().parents[2])
    rest = os.environ.get("PYTHONPATH")
    return f"{here}{os.pathsep}{rest}" if rest else here


def base_config(**extra: Any) -> dict[str, Any]:
    """``make_config`` with the three demo tenants, no backend yet (LiveStack adds it), and the
    bench's admin key (proxy_usage reads /metrics with it)."""
    extra.setdefault("admin_keys", [{"sha256": hash_key(BENCH_ADMIN_KEY)}])
    return make_config([], **extra)


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """VmRSS (now) or VmHWM (the peak so far) of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise LookupError(f"{field} not in /proc/{pid}/status")


@dataclass(frozen=True)
class ProxyUsage:
    rss_bytes: int
    open_fds: int
    tasks: int
    inflight: int  # backend slots the proxy holds (tierproxy_backend_inflight, all backends)

    def line(self, label: str) -> str:
        return (
            f"{label:20} RSS {self.rss_bytes / 2**20:7.1f} MiB  open fds {self.open_fds:5d}"
            f"  event-loop tasks {self.tasks:5d}  backend slots held {self.inflight}"
        )


async def proxy_usage(http: aiohttp.ClientSession, stack: LiveStack) -> ProxyUsage:
    """RSS and open files from /proc; tasks and slots from the proxy's /metrics (the scrape
    itself is one of the tasks counted)."""
    text = await fetch_metrics(http, stack.url, timeout_s=10.0, key=BENCH_ADMIN_KEY)
    if text is None:
        raise RuntimeError("the proxy's /metrics did not answer")
    pid = stack.proxy_pid
    return ProxyUsage(
        rss_bytes=rss_bytes(pid),
        open_fds=len(os.listdir(f"/proc/{pid}/fd")),
        tasks=int(total(text, "tierproxy_event_loop_tasks")),
        inflight=int(total(text, "tierproxy_backend_inflight")),
    )


def chat_body(model: str, max_tokens: int, content: str = "Count to ten.", **extra: Any) -> Any:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


async def stream_ttft(
    http: aiohttp.ClientSession, url: str, tier: str, body: dict[str, Any], timeout_s: float = 60
) -> tuple[int, float | None]:
    """(status, seconds to the first SSE data line) of one streamed chat request."""
    started = time.perf_counter()
    async with http.post(
        f"{url}/v1/chat/completions",
        json={**body, "stream": True},
        headers=auth(tier),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as resp:
        first: float | None = None
        async for line in resp.content:
            if first is None and line.startswith(b"data:"):
                first = time.perf_counter() - started
        return resp.status, first


_TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0A": "LISTEN"}


def open_sockets(pid: int, proxy_port: int, engine_port: int) -> dict[str, int]:
    """The process's TCP sockets by what they connect: listening, client connections (local
    port = the proxy's), connections to vLLM (remote port = the engine's), other; with their
    TCP state where it is not ESTABLISHED (CLOSE_WAIT: the peer closed, we did not)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    kinds: collections.Counter[str] = collections.Counter()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[9] not in inodes:
                    continue
                local = int(fields[1].rsplit(":", 1)[1], 16)
                remote = int(fields[2].rsplit(":", 1)[1], 16)
                state = _TCP_STATES.get(fields[3], fields[3])
                if state == "LISTEN":
                    kinds["listening"] += 1
                    continue
                kind = (
                    "client"
                    if local == proxy_port
                    else "to vLLM"
                    if remote == engine_port
                    else "other"
                )
                kinds[kind if state == "ESTABLISHED" else f"{kind} {state}"] += 1
    return dict(kinds)
