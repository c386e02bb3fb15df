"""`tierproxy bench`: run a scenario through the proxy and directly against vLLM, side by side.

    tierproxy bench --local --scenario overload-2x           # starts vLLM + proxy itself
    tierproxy bench --target http://127.0.0.1:8000 --direct http://127.0.0.1:8100 \\
                    --scenario seed-mixed --duration 60
    tierproxy bench --scenario fairness --write-proxy-config bench.yaml \\
                    --backend http://127.0.0.1:8100          # then: tierproxy serve -c bench.yaml

Exit status: 0 when every run finished with no lost request, 2 when a request was lost,
1 on a usage or setup error.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import resource
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from proxy.bench import plots
from proxy.bench import results as results_file
from proxy.bench.args import build_parser
from proxy.bench.capacity import Capacity, measure_capacity
from proxy.bench.plan import build_plan
from proxy.bench.progress import TerminalProgress
from proxy.bench.proxy_config import proxy_config, write_proxy_config
from proxy.bench.report import comparison, render_comparison, render_run, run_report
from proxy.bench.runner import RunResult, RunSettings, run_plan
from proxy.bench.scenario import (
    Scenario,
    ScenarioError,
    available_scenarios,
    load_scenario,
)
from proxy.bench.scrape import wait_idle
from proxy.bench.stats import Slo
from proxy.config.loader import ConfigError

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def main(argv: Sequence[str]) -> int:
    """`tierproxy bench ARGS`; SIGTERM unwinds like Ctrl-C meanwhile (engines get stopped)."""
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    previous = signal.getsignal(signal.SIGTERM)

    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _raise)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if argv[:1] == ["--"]:  # `tierproxy bench -- --scenario ...`
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    if args.list_scenarios:
        return _list()
    if args.report is not None:
        return rerender(args.report, not args.no_plots)
    try:
        scenario = load_scenario(args.scenario)
        if args.write_proxy_config is not None:
            return _write_config(args, scenario)
        _check_targets(args)
        _raise_fd_limit()
        out = args.out or Path(".tierproxy/bench") / (
            f"{scenario.name}-{dt.datetime.now():%Y%m%d-%H%M%S}"
        )
        out.mkdir(parents=True, exist_ok=True)
        if args.local:
            return _run_local(args, scenario, out)
        return asyncio.run(_bench(args, scenario, out, args.target, args.direct))
    except (ScenarioError, ConfigError, ValueError, RuntimeError, TimeoutError) as exc:
        print(f"tierproxy bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tierproxy bench: interrupted", file=sys.stderr)
        return 130


def _list() -> int:
    for name in available_scenarios():
        s = load_scenario(name)
        rate = f"{s.load_factor:g}x capacity" if s.relative else f"{s.rate_rps:g} req/s"
        about = textwrap.shorten(" ".join(s.description.split()), 96, placeholder=" ...")
        print(f"{name:<12} {rate:<15} {s.total_duration():>3.0f}s  {len(s.tenants)} tenants")
        if about:
            print(f"    {about}")
    return 0


def _write_config(args: argparse.Namespace, scenario: Scenario) -> int:
    if not args.backend:
        raise ValueError("--write-proxy-config needs at least one --backend URL")
    data = proxy_config(
        scenario,
        args.backend,
        port=args.proxy_port,
        max_inflight=args.max_inflight or None,
        early_refusal=args.early_refusal,
    )
    path = write_proxy_config(data, args.write_proxy_config, scenario)
    print(f"wrote {path}: {len(scenario.tenants)} tenants in tiers {', '.join(scenario.tiers)}")
    print(f"run it with: tierproxy serve -c {path}")
    return 0


def _check_targets(args: argparse.Namespace) -> None:
    if args.local:
        if args.target or args.direct:
            raise ValueError("--local starts its own targets: drop --target/--direct")
        return
    if not args.target and not args.direct:
        raise ValueError("give --target (the proxy) and/or --direct (vLLM), or --local")
    for url in (args.target, args.direct):
        if url is None:
            continue
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http(s) URL")
        if parts.hostname not in LOOPBACK and not args.allow_remote:
            raise ValueError(f"{url} is not on this machine; pass --allow-remote to load it")


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _run_local(args: argparse.Namespace, scenario: Scenario, out: Path) -> int:
    from proxy.bench.stack import LocalStack

    with LocalStack(
        scenario,
        out,
        model=args.model,
        max_num_seqs=args.max_num_seqs,
        max_inflight=args.max_inflight or None,
        early_refusal=args.early_refusal,
        plugin=not args.no_plugin,
    ) as stack:
        stack.start()
        if args.model is None:
            args.model = stack.served_name
        return asyncio.run(_bench(args, scenario, out, stack.proxy_url, stack.engine_url))


async def _bench(
    args: argparse.Namespace,
    scenario: Scenario,
    out: Path,
    target: str | None,
    direct: str | None,
) -> int:
    probe = direct or target
    assert probe is not None
    model = args.model or await detect_model(probe, scenario.tenants[0].api_key)
    capacity: Capacity | None = None
    rate = args.rate
    if rate is None:
        if args.capacity not in (None, "measure"):
            capacity_rps = float(args.capacity)
        elif scenario.relative or args.capacity == "measure" or args.capacity_only:
            print(
                f"measuring capacity on {probe} ({args.capacity_duration:g}s closed loop,"
                f" {args.capacity_concurrency} in flight)...",
                file=sys.stderr,
                flush=True,
            )
            capacity = await measure_capacity(
                scenario,
                probe,
                model,
                seed=args.seed,
                duration_s=args.capacity_duration,
                concurrency=args.capacity_concurrency,
            )
            capacity_rps = capacity.rps
            print(
                f"capacity: {capacity.rps:.2f} req/s, {capacity.output_tokens_per_s:.0f}"
                f" output tokens/s ({capacity.failed} failed)",
                flush=True,
            )
            if args.capacity_only:
                return 0
            if capacity.rps <= 0:
                raise RuntimeError("capacity measured as 0 req/s: is the target answering?")
        else:
            capacity_rps = 0.0
        rate = scenario.load_factor * capacity_rps if scenario.relative else scenario.rate_rps
    assert rate is not None
    plan = build_plan(scenario, rate, args.seed, args.duration)
    duration = scenario.total_duration(args.duration)
    print(
        f"scenario {scenario.name}: {rate:.2f} req/s for {duration:.0f}s, {len(plan)} requests,"
        f" {len(scenario.tenants)} tenants, model {model!r}",
        flush=True,
    )

    runs: list[tuple[str, str]] = []
    if target:
        runs.append(("proxy", target))
    if direct:
        runs.append(("direct", direct))
    results: dict[str, RunResult] = {}
    for i, (label, url) in enumerate(runs):
        if i > 0 and direct:
            async with aiohttp.ClientSession() as session:
                await wait_idle(session, direct)
        settings = RunSettings(
            label=label,
            base_url=url,
            model=model,
            request_timeout_s=args.request_timeout,
            engine_url=direct,
            run_id=f"bench-{label}-{int(time.time())}",
        )
        results[label] = await run_plan(plan, settings, TerminalProgress())

    reports = _print_reports(scenario, results)
    rows = comparison(reports)
    meta = results_file.RunMeta(
        model=model, seed=args.seed, rate_rps=rate, duration_s=duration, capacity=capacity
    )
    results_path = results_file.write(
        out / "results.json", results_file.document(scenario, meta, results, reports, rows)
    )
    print(f"\nresults: {results_path}")
    if not args.no_plots:
        _plot(scenario, results, out)
    return _exit_code(reports)


def _print_reports(scenario: Scenario, results: dict[str, RunResult]) -> dict[str, dict[str, Any]]:
    slos: dict[str, Slo] = {t: s for t in scenario.tiers if (s := scenario.slo_for(t))}
    peers = scenario.peers()
    reports = {label: run_report(r, slos, scenario.tiers, peers) for label, r in results.items()}
    for rep in reports.values():
        print()
        print(render_run(rep))
    if len(reports) > 1:
        print()
        print(render_comparison(comparison(reports), list(reports)))
    return reports


def _plot(scenario: Scenario, results: dict[str, RunResult], out: Path) -> None:
    cdf = plots.ttft_cdf(
        {k: r.records for k, r in results.items()}, scenario.tiers, out / "ttft_cdf.png"
    )
    depth = plots.queue_depth(
        {k: r.samples for k, r in results.items()}, scenario.tiers, out / "queue_depth.png"
    )
    print(f"plots: {cdf} {depth}")


def _exit_code(reports: dict[str, dict[str, Any]]) -> int:
    lost = sum(rep["total"]["outcomes"]["lost"] for rep in reports.values())
    if lost:
        print(f"LOST REQUESTS: {lost} (see 'error' in results.json)", file=sys.stderr)
        return 2
    return 0


def rerender(path: Path, with_plots: bool) -> int:
    """Tables (and plots, next to the file) again from a stored results.json."""
    loaded = results_file.load(path)
    print(
        f"scenario {loaded.scenario.name}: {loaded.rate_rps:.2f} req/s for {loaded.duration_s:.0f}s"
    )
    reports = _print_reports(loaded.scenario, loaded.results)
    if with_plots:
        _plot(loaded.scenario, loaded.results, path.parent)
    return _exit_code(reports)


async def detect_model(base_url: str, key: str, timeout_s: float = 10.0) -> str:
    """The first model id that /v1/models lists."""
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                f"{base_url}/v1/models",
                headers={"Authorization": f"Bearer {key}"},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp,
        ):
            if resp.status != 200:
                raise RuntimeError(f"{base_url}/v1/models answered {resp.status}; pass --model")
            data = await resp.json()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise RuntimeError(f"cannot list models at {base_url}: {exc!r}") from exc
    models = data.get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])
