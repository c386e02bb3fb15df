"""Stock vLLM vs vLLM with the tierproxy plugin, side by side (CPU build, tiny model by default).

    .venv/bin/python benchmarks/plugin_bench.py [--repeats 3]
    .venv/bin/python benchmarks/plugin_bench.py --stock-url http://h:8001 --plugin-url http://h:8002

Without URLs it starts both engines itself (same flags, see plugin_scenarios.ENGINE_ARGS; the
plugin one adds --middleware / --scheduler-cls) one after the other, and stops them. Figures:

- TTFT of a high-tier request arriving while 4 long low-tier generations fill --max-num-seqs 4
  (queued to first token, engine clock), and whether the low-tier requests still completed;
- high-tier inter-token latency p50 / p99 (vLLM's ITL histogram) while 4000-token low-tier
  prompts keep arriving, and how many steps scheduled more than 1024 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plugin_scenarios as sc

from proxy.engine import EngineProcess, EngineSpec, free_port

SECRET = os.environ.get("TIERPROXY_TICKET_SECRET") or "plugin-bench-secret"


@dataclass
class Figures:
    ttft_ms: list[float] = field(default_factory=list)
    lows_complete: list[bool] = field(default_factory=list)
    preemptions: list[float] = field(default_factory=list)
    itl_p50_ms: list[float] = field(default_factory=list)
    itl_p99_ms: list[float] = field(default_factory=list)
    big_steps: list[int] = field(default_factory=list)


async def measure(url: str, repeats: int) -> Figures:
    key = SECRET.encode()
    fig = Figures()
    for _ in range(repeats):
        pre = await sc.preempt_scenario(url, key)
        fig.ttft_ms.append(pre.high.server_ttft * 1000)
        fig.lows_complete.append(
            all(
                r.finish_reason == "length" and r.completion_tokens == sc.LOW_TOKENS
                for r in pre.lows
            )
        )
        fig.preemptions.append(pre.preemptions)
        itl = await sc.itl_scenario(url, key)
        fig.itl_p50_ms.append(itl.p50 * 1000)
        fig.itl_p99_ms.append(itl.p99 * 1000)
        fig.big_steps.append(itl.big_steps)
    return fig


def start_engine(plugin: bool, log_dir: Path) -> EngineProcess:
    from proxy.tiny_model import make_tiny_model

    model = make_tiny_model(Path(".tierproxy/tiny-model")).resolve()
    spec = EngineSpec(
        port=free_port(),
        model=str(model),
        served_name=sc.MODEL,
        max_num_seqs=4,
        plugin=plugin,
        extra_args=sc.ENGINE_ARGS,
        env={"TIERPROXY_TICKET_SECRET": SECRET},
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
        ("steps over 1024 tokens per run", _runs(stock.big_steps), _runs(plugin.big_steps)),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}}  {'stock':>22}  {'plugin':>22}"]
    lines += [f"{name:<{width}}  {a:>22}  {b:>22}" for name, a, b in rows]
    ratio = statistics.median(stock.ttft_ms) / max(statistics.median(plugin.ttft_ms), 1e-9)
    lines.append(f"TTFT ratio stock/plugin: {ratio:.0f}x")
    return "\n".join(lines)


def _runs(values: list[float] | list[int]) -> str:
    return " ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stock-url", help="a running stock vLLM (with ENGINE_ARGS)")
    parser.add_argument("--plugin-url", help="a running vLLM with the plugin (same flags)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="plugin-bench-") as tmp:
        log_dir = Path(tmp)
        stock = run_on(False, args.stock_url, args.repeats, log_dir)
        plugin = run_on(True, args.plugin_url, args.repeats, log_dir)
    print(report(stock, plugin))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
