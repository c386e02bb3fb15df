"""The figures compared: vLLM's own token counters, the usage log, the quota counters.

vLLM counts a prompt once per sequence it prefills: a request with ``n`` choices counts it ``n``
times in ``vllm:prompt_tokens_total``, while its usage says it once. The bill counts it ``n``
times too (``ParsedRequest.prompt_billed``): each choice prefills it again. The report also
prints the engine's figure less those ``(n - 1) x prompt`` (``engine_prompt_per_request``): what
the usage alone says.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from proxy.bench.reconcile.client import Sent
from proxy.bench.reconcile.mix import Planned
from proxy.telemetry.prometheus import total

METRICS_TIMEOUT = aiohttp.ClientTimeout(total=10)


@dataclass(frozen=True)
class EngineCounts:
    prompt: float
    generation: float
    busy: float  # requests running or waiting

    def __sub__(self, other: EngineCounts) -> EngineCounts:
        return EngineCounts(self.prompt - other.prompt, self.generation - other.generation, 0)


async def engine_counts(session: aiohttp.ClientSession, engine_url: str) -> EngineCounts:
    async with session.get(f"{engine_url}/metrics", timeout=METRICS_TIMEOUT) as resp:
        text = await resp.text()
    busy = total(text, "vllm:num_requests_running") + total(text, "vllm:num_requests_waiting")
    return EngineCounts(
        total(text, "vllm:prompt_tokens_total"), total(text, "vllm:generation_tokens_total"), busy
    )


async def settled_engine_counts(
    session: aiohttp.ClientSession, engine_url: str, timeout_s: float = 60.0
) -> EngineCounts:
    """The counters once the engine runs nothing (cut requests aborted, all counted)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = await engine_counts(session, engine_url)
        if counts.busy == 0 or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.2)


def usage_records(log: Path) -> list[dict[str, Any]]:
    text = log.read_bytes() if log.exists() else b""
    return [orjson.loads(line) for line in text.splitlines() if line.strip()]


async def wait_for_records(log: Path, ids: set[str], timeout_s: float = 60.0) -> None:
    """Until the usage log holds a line for every request id sent (each request gets one)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = {r.get("client_request_id") for r in usage_records(log)}
        if ids <= seen:
            return
        await asyncio.sleep(0.1)


@dataclass
class CategoryFigures:
    name: str
    sent: list[Sent]
    records: list[dict[str, Any]]
    engine: EngineCounts

    @property
    def billed_prompt(self) -> int:
        return sum(int(r["prompt_tokens"]) for r in self.records)

    @property
    def billed_output(self) -> int:
        return sum(int(r["completion_tokens"]) for r in self.records)

    @property
    def repeated_prompt(self) -> int:
        """Prompt tokens vLLM prefilled again for the 2nd..nth choice of a request (the bill
        counts the prompt once per choice)."""
        n_of = {s.planned.request_id: s.planned.choices for s in self.sent}
        repeated = 0
        for r in self.records:
            n = n_of.get(r.get("client_request_id") or "", 1)
            repeated += int(r["prompt_tokens"]) // n * (n - 1)
        return repeated

    @property
    def engine_prompt_per_request(self) -> float:
        return self.engine.prompt - self.repeated_prompt

    def statuses(self) -> str:
        counts = Counter(s.status for s in self.sent)
        cut = sum(1 for s in self.sent if s.cut)
        text = " ".join(f"{k}x{v}" for k, v in sorted(counts.items()))
        return text + (f" cut {cut}" if cut else "")

    def outcomes(self) -> str:
        counts = Counter(str(r["outcome"]) for r in self.records)
        return " ".join(f"{k}x{v}" for k, v in sorted(counts.items()))


def ratio(billed: float, engine: float) -> float:
    return billed / engine if engine else (1.0 if billed == 0 else float("inf"))


@dataclass
class CounterFigure:
    tenant: str
    counter: str
    used: float
    limit: float
    worst: float  # the largest reservation one of its requests could make

    @property
    def over_by(self) -> float:
        return self.used - self.limit


@dataclass
class Reconciliation:
    categories: list[CategoryFigures]
    counters: list[CounterFigure] = field(default_factory=list)
    counter_tokens: float = 0.0  # sum of every tenant's tokens_per_day counter
    events: list[str] = field(default_factory=list)  # what happened to Redis, when

    def totals(self) -> tuple[int, int, float, float, float]:
        cats = self.categories
        return (
            sum(c.billed_prompt for c in cats),
            sum(c.billed_output for c in cats),
            sum(c.engine.prompt for c in cats),
            sum(c.engine.generation for c in cats),
            sum(c.engine_prompt_per_request for c in cats),
        )

    def prompt_ratio(self) -> float:
        billed_p, _, engine_p, _, _ = self.totals()
        return ratio(billed_p, engine_p)

    def output_ratio(self) -> float:
        _, billed_o, _, engine_o, _ = self.totals()
        return ratio(billed_o, engine_o)

    def counter_ratio(self) -> float:
        _, _, engine_p, engine_o, _ = self.totals()
        return ratio(self.counter_tokens, engine_p + engine_o)

    def counters_over(self) -> list[CounterFigure]:
        """Counters past their limit by more than one request's worst case."""
        return [c for c in self.counters if c.over_by > c.worst]

    def table(self) -> str:
        rows = [
            "category  requests (client)          usage log                  billed/engine"
            " prompt (usage once) output",
        ]
        for c in self.categories:
            rows.append(
                f"{c.name:<9} {c.statuses():<26} {c.outcomes():<26}"
                f" {c.billed_prompt:>6}/{c.engine.prompt:<6.0f}"
                f" {_pct(c.billed_prompt, c.engine.prompt):>7}"
                f" ({_pct(c.billed_prompt - c.repeated_prompt, c.engine_prompt_per_request)})"
                f"  {c.billed_output:>6}/{c.engine.generation:<6.0f}"
                f" {_pct(c.billed_output, c.engine.generation):>7}"
            )
        billed_p, billed_o, engine_p, engine_o, engine_once = self.totals()
        repeated = sum(c.repeated_prompt for c in self.categories)
        rows.append(
            f"{'total':<9} {'':<26} {'':<26} {billed_p:>6}/{engine_p:<6.0f}"
            f" {_pct(billed_p, engine_p):>7} ({_pct(billed_p - repeated, engine_once)})"
            f"  {billed_o:>6}/{engine_o:<6.0f} {_pct(billed_o, engine_o):>7}"
        )
        rows.append(
            f"quota counters (tokens_per_day, all tenants): {self.counter_tokens:.0f} /"
            f" engine {engine_p + engine_o:.0f} = {_pct(self.counter_tokens, engine_p + engine_o)};"
            f" / usage log {billed_p + billed_o} = {_pct(self.counter_tokens, billed_p + billed_o)}"
        )
        for k in self.counters:
            rows.append(
                f"  {k.tenant:<7} {k.counter:<15} used {k.used:>10.0f} of {k.limit:>10.0f}"
                f" (over by {max(0.0, k.over_by):.0f}; one worst case {k.worst:.0f})"
            )
        rows += [f"  redis: {e}" for e in self.events]
        return "\n".join(rows)


def _pct(billed: float, engine: float) -> str:
    return f"{100 * ratio(billed, engine):.1f}%"


def records_of(
    records: Iterable[dict[str, Any]], planned: Sequence[Planned]
) -> list[dict[str, Any]]:
    ids = {p.request_id for p in planned}
    return [r for r in records if r.get("client_request_id") in ids]
