"""Figures taken against a served proxy, for its tests and for benchmarks/hostile.py: the memory
of unfinished request heads, and what a flood past the connection cap costs the log."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from proxy.bench.hostile.kit import crowd, request_bytes, unfinished_headers
from proxy.bench.hostile.served import ServedProxy

MIB = 2**20


@dataclass(frozen=True)
class HeaderMemory:
    connections: int
    head_bytes: int  # what each tried to send
    idle_rss: int
    held_rss: int  # with them all open
    after_rss: int  # once they closed
    still_open: int  # of the connections, when the RSS was read
    answers: dict[str, int]

    @property
    def per_1000_mib(self) -> float:
        return (self.held_rss - self.idle_rss) / MIB * 1000 / self.connections

    def line(self) -> str:
        return (
            f"{self.connections} connections sending {self.head_bytes / 1024:.0f} KiB of headers"
            f" without the blank line: RSS idle {self.idle_rss / MIB:.0f} MiB, held"
            f" {self.held_rss / MIB:.0f} MiB ({self.per_1000_mib:.1f} MiB per 1,000),"
            f" after {self.after_rss / MIB:.0f} MiB; {self.still_open} still open;"
            f" answers {dict(sorted(self.answers.items()))}"
        )


async def header_memory(
    proxy: ServedProxy, connections: int, head: bytes, settle_s: float = 1.0
) -> HeaderMemory:
    """``connections`` clients each sending ``head`` (no blank line), then reading nothing; the
    proxy's RSS before, with them open, and after they closed."""
    idle = proxy.rss_bytes()
    held = await crowd(proxy.host, proxy.port, connections, payload=head, timeout_s=5)
    try:
        await asyncio.sleep(settle_s)  # the proxy reads what is in flight
        held_rss = proxy.rss_bytes()
        answers: collections.Counter[str] = collections.Counter()
        closed = await _closed_once_quiet([c.closed_by_peer(timeout_s=60.0) for c in held.clients])
        still_open = closed.count(False)
        if still_open:
            answers["none yet"] = still_open
        for client, done in zip(held.clients, closed, strict=True):
            if done:
                status = bytes(client.buffer[9:12]).decode("latin-1")
                answers[status or "closed, no answer"] += 1
    finally:
        held.close()
    await asyncio.sleep(settle_s)
    return HeaderMemory(
        connections, len(head), idle, held_rss, proxy.rss_bytes(), still_open, dict(answers)
    )


async def _closed_once_quiet(
    waits: list[Coroutine[Any, Any, bool]], quiet_s: float = 2.0, cap_s: float = 60.0
) -> list[bool]:
    """Which connections the proxy closed, read once it stops closing them (no new close for
    ``quiet_s``), not after a fixed time: a busy machine slows the proxy's reading of 300
    heads, and a fixed second counted the ones it had not reached yet as held open."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    seen, deadline = -1, time.monotonic() + cap_s
    try:
        while time.monotonic() < deadline:
            await asyncio.sleep(quiet_s)
            now = sum(1 for t in tasks if t.done() and t.result())
            if now == seen or now == len(tasks):
                break
            seen = now
        return [t.done() and t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def hostile_head(size: int) -> bytes:
    """An unfinished head of about ``size`` bytes in fields of up to 8,000 bytes."""
    fields = max(1, -(-size // 8000))
    return unfinished_headers(field_bytes=size // fields, fields=fields)


@dataclass(frozen=True)
class OverCap:
    refused: int
    answered_503: int
    log_lines: int
    tracebacks: int
    seconds: float

    def line(self) -> str:
        return (
            f"{self.refused} connections over the cap in {self.seconds:.1f} s: 503 JSON answered"
            f" {self.answered_503}; log lines {self.log_lines}"
            f" ({self.log_lines / max(1, self.refused):.3f} per refused connection),"
            f" tracebacks {self.tracebacks}"
        )


async def over_cap(proxy: ServedProxy, cap: int, refused: int) -> OverCap:
    """``cap`` idle connections hold the cap; ``refused`` more each send a request."""
    held = await crowd(proxy.host, proxy.port, cap)
    try:
        await asyncio.sleep(0.5)  # accepted by the proxy
        mark = proxy.mark()
        started = time.monotonic()
        flood = await crowd(
            proxy.host, proxy.port, refused, payload=request_bytes("GET", "/v1/models")
        )
        try:
            answers = await flood.answers(timeout_s=10)
        finally:
            flood.close()
        seconds = time.monotonic() - started
    finally:
        held.close()
    await asyncio.sleep(0.2)  # the log written
    ok = sum(1 for a in answers if a is not None and a.status == 503)
    return OverCap(refused, ok, len(proxy.lines_since(mark)), proxy.tracebacks(mark), seconds)
