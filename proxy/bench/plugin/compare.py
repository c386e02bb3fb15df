"""Stock vLLM against vLLM with the plugin, on the same flags: the figures of
benchmarks/plugin_bench.py (see its docstring for what each one measures)."""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from proxy.bench.plugin.requests import ENGINE_ARGS, LOW_TOKENS, MODEL
from proxy.bench.plugin.scenarios import (
    deadline_scenario,
    forged_scenario,
    itl_scenario,
    preempt_scenario,
)
from proxy.ticket import DEFAULT_SECRET_ENV
from proxy.tools.engine import (
    EngineProcess,
    local_engine,
)


def secret() -> str:
    """The engines' ticket secret: the environment's, else a fixed one for the bench."""
    return os.environ.get(DEFAULT_SECRET_ENV) or "plugin-bench-secret-of-at-least-32-bytes"


@dataclass
class Figures:
    ttft_ms: list[float] = field(default_factory=list)
    lows_complete: list[bool] = field(default_factory=list)
    preemptions: list[float] = field(default_factory=list)
    itl_p50_ms: list[float] = field(default_factory=list)
    itl_p99_ms: list[float] = field(default_factory=list)
    itl_samples: list[int] = field(default_factory=list)
    forged_queue_ms: list[float] = field(default_factory=list)  # slowest-queued attack
    forged_min_queue_ms: list[float] = field(default_factory=list)  # fastest-queued attack
    control_queue_ms: list[float] = field(default_factory=list)
    forged_preemptions: list[float] = field(default_factory=list)
    deadline_finish: list[str] = field(default_factory=list)
    deadline_tokens: list[int] = field(default_factory=list)


async def measure(url: str, repeats: int) -> Figures:
    key = secret().encode()
    fig = Figures()
    for _ in range(repeats):
        pre = await preempt_scenario(url, key)
        fig.ttft_ms.append(pre.high.server_ttft * 1000)
        fig.lows_complete.append(
            all(r.finish_reason == "length" and r.completion_tokens == LOW_TOKENS for r in pre.lows)
        )
        fig.preemptions.append(pre.preemptions)
        itl = await itl_scenario(url, key)
        fig.itl_p50_ms.append(itl.p50 * 1000)
        fig.itl_p99_ms.append(itl.p99 * 1000)
        fig.itl_samples.append(itl.samples)
    forged = await forged_scenario(url, key)
    queues = [r.queue_time * 1000 for r in forged.attacks.values()]
    fig.forged_queue_ms.append(max(queues))
    fig.forged_min_queue_ms.append(min(queues))
    fig.control_queue_ms.append(forged.control.queue_time * 1000)
    fig.forged_preemptions.append(forged.preemptions)
    try:
        dl = await deadline_scenario(url, key)
    except AssertionError as exc:
        # Stock vLLM runs them late, so only seeing them wait on the gauges establishes the
        # scenario there; a starved API server may not show it in time.
        print(f"deadline scenario on {url}: {exc}", file=sys.stderr)
        fig.deadline_finish.append("n/a")
    else:
        fig.deadline_finish.append(f"{dl.plain.finish_reason}/{dl.streamed.finish_reason}")
        fig.deadline_tokens.append(
            (dl.plain.completion_tokens or 0) + (dl.streamed.completion_tokens or 0)
        )
    return fig


def start_engine(plugin: bool, log_dir: Path) -> EngineProcess:
    spec = local_engine(
        served_name=MODEL,
        index=1 if plugin else 0,  # as the tests do; vLLM's "auto" picks core 0
        max_num_seqs=4,
        plugin=plugin,
        extra_args=ENGINE_ARGS,
        env={DEFAULT_SECRET_ENV: secret()},
    )
    name = "plugin" if plugin else "stock"
    engine = EngineProcess(spec, log_dir / f"vllm-{name}.log").start()
    try:
        engine.wait_ready()
    except BaseException:
        engine.stop()
        raise
    return engine


def run_on(plugin: bool, url: str | None, repeats: int, log_dir: Path) -> Figures:
    if url:
        return asyncio.run(measure(url, repeats))
    engine = start_engine(plugin, log_dir)
    try:
        return asyncio.run(measure(engine.spec.url, repeats))
    finally:
        engine.stop()


def _med(values: list[float] | list[int]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def report(stock: Figures, plugin: Figures) -> str:
    rows = [
        ("high TTFT behind 4 long low (ms, median)", _med(stock.ttft_ms), _med(plugin.ttft_ms)),
        ("  all runs (ms)", _runs(stock.ttft_ms), _runs(plugin.ttft_ms)),
        ("preemptions per run", _runs(stock.preemptions), _runs(plugin.preemptions)),
        (
            "low-tier requests completed in full",
            str(all(stock.lows_complete)),
            str(all(plugin.lows_complete)),
        ),
        (
            "high ITL p50 under long low prompts (ms)",
            _med(stock.itl_p50_ms),
            _med(plugin.itl_p50_ms),
        ),
        (
            "high ITL p99 under long low prompts (ms)",
            _med(stock.itl_p99_ms),
            _med(plugin.itl_p99_ms),
        ),
        ("  all runs p99 (ms)", _runs(stock.itl_p99_ms), _runs(plugin.itl_p99_ms)),
        ("  ITL samples per run", _runs(stock.itl_samples), _runs(plugin.itl_samples)),
        (
            "forged/unsigned priority: attacks queued (ms)",
            f"{_med(stock.forged_min_queue_ms)}..{_med(stock.forged_queue_ms)}",
            f"{_med(plugin.forged_min_queue_ms)}..{_med(plugin.forged_queue_ms)}",
        ),
        (
            "  signed high control queued (ms)",
            _med(stock.control_queue_ms),
            _med(plugin.control_queue_ms),
        ),
        (
            "  preemptions (control only = 1)",
            _runs(stock.forged_preemptions),
            _runs(plugin.forged_preemptions),
        ),
        (
            "deadline passed while waiting: finish",
            " ".join(stock.deadline_finish),
            " ".join(plugin.deadline_finish),
        ),
        (
            "  tokens generated for them",
            _runs(stock.deadline_tokens),
            _runs(plugin.deadline_tokens),
        ),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}}  {'stock':>22}  {'plugin':>22}"]
    lines += [f"{name:<{width}}  {a:>22}  {b:>22}" for name, a, b in rows]
    ratio = statistics.median(stock.ttft_ms) / max(statistics.median(plugin.ttft_ms), 1e-9)
    lines.append(f"TTFT ratio stock/plugin: {ratio:.0f}x")
    return "\n".join(lines)


def _runs(values: list[float] | list[int]) -> str:
    return " ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in values)
