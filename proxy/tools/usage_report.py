"""``tierproxy usage LOG``: totals of the usage log (and its rotated files) by tenant, tier or
model, since a time."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from proxy.ops.usage_log import rotated_paths

GROUPS = ("tenant", "tier", "model", "backend", "outcome", "key_id")
_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: float) -> float:
    """Unix seconds from ``30m`` / ``2h`` / ``7d`` (ago) or an ISO date/time (local time when
    it names no zone). ValueError otherwise."""
    m = _RELATIVE.match(text.strip())
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise ValueError(f"--since {text!r}: give 30m, 2h, 7d or an ISO time") from None


@dataclass
class Totals:
    requests: int = 0
    ok: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_s: float = 0.0
    engine_s: float = 0.0
    cached_prompt_tokens: int = 0
    cost: float = 0.0
    unpriced: int = 0  # records that used tokens but carry no cost (a model without a price)

    def add(self, rec: dict[str, Any]) -> None:
        self.requests += 1
        self.ok += rec.get("outcome") == "ok"
        self.prompt_tokens += int(rec.get("prompt_tokens") or 0)
        self.completion_tokens += int(rec.get("completion_tokens") or 0)
        self.queue_s += float(rec.get("queue_s") or 0.0)
        self.engine_s += float(rec.get("engine_s") or 0.0)
        self.cached_prompt_tokens += int(rec.get("cached_prompt_tokens") or 0)
        cost = rec.get("cost")
        if isinstance(cost, int | float) and not isinstance(cost, bool):
            self.cost += float(cost)
        elif rec.get("prompt_tokens") or rec.get("completion_tokens"):
            self.unpriced += 1

    def merge(self, other: Totals) -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)


@dataclass
class Report:
    totals: dict[str, Totals]
    unreadable: int  # lines that were not usage records (a torn last line after a crash)
    files: list[Path]


def records(paths: Iterable[Path]) -> Iterator[dict[str, Any] | None]:
    """Every line's record, oldest file first; None for a line that is not one."""
    for path in paths:
        with open(path, "rb") as f:
            for line in f:
                try:
                    rec = orjson.loads(line)
                except orjson.JSONDecodeError:
                    yield None
                    continue
                yield rec if isinstance(rec, dict) else None


def summarize(log: Path, by: str, since: float | None = None) -> Report:
    files = rotated_paths(log)
    totals: dict[str, Totals] = {}
    unreadable = 0
    for rec in records(files):
        if rec is None or not isinstance(rec.get("ts"), int | float):
            unreadable += 1
            continue
        if since is not None and rec["ts"] < since:
            continue
        key = rec.get(by)
        totals.setdefault(str(key) if key is not None else "-", Totals()).add(rec)
    return Report(totals, unreadable, files)


def render(report: Report, by: str, cost: bool = False) -> str:
    """The table; with ``cost``: the cached prompt tokens and the cost of each row (by the
    `pricing:` in force when each request ran), busiest by cost first."""
    head: tuple[str, ...] = (by, "requests", "ok", "prompt_tok", "completion_tok")
    head += ("queue_s", "engine_s")
    if cost:
        head += ("cached_tok", "cost")
    rows = [head]
    if cost:
        ordered = sorted(report.totals.items(), key=lambda kv: (-kv[1].cost, kv[0]))
    else:
        ordered = sorted(report.totals.items(), key=lambda kv: (-kv[1].completion_tokens, kv[0]))
    grand = Totals()
    for key, t in ordered:
        rows.append(_row(key, t, cost))
        grand.merge(t)
    rows.append(_row("total", grand, cost))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    if report.unreadable:
        lines.append(f"({report.unreadable} unreadable line(s) skipped)")
    if cost and grand.unpriced:
        lines.append(f"({grand.unpriced} request(s) with tokens but no price: not in the cost)")
    return "\n".join(lines)


def _row(key: str, t: Totals, cost: bool = False) -> tuple[str, ...]:
    extra = (str(t.cached_prompt_tokens), f"{t.cost:.4f}") if cost else ()
    return (
        key,
        str(t.requests),
        str(t.ok),
        str(t.prompt_tokens),
        str(t.completion_tokens),
        f"{t.queue_s:.1f}",
        f"{t.engine_s:.1f}",
        *extra,
    )
