"""`tierproxy bench`'s command line."""

from __future__ import annotations

import argparse
from pathlib import Path


def _capacity_arg(value: str) -> str:
    if value != "measure":
        try:
            ok = float(value) > 0
        except ValueError:
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError("give a positive rate in requests/s, or nothing")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tierproxy bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--scenario",
        default="seed-mixed",
        help="a shipped scenario name (see --list-scenarios) or a YAML file",
    )
    p.add_argument("--target", help="the proxy's base URL (the run labelled 'proxy')")
    p.add_argument("--direct", help="vLLM's base URL (the run labelled 'direct')")
    p.add_argument(
        "--local",
        action="store_true",
        help="start a local vLLM (tiny model unless --model) and the proxy, run both",
    )
    p.add_argument("--duration", type=float, help="seconds of offered load (scales phases)")
    p.add_argument("--rate", type=float, help="requests/s offered (overrides the scenario's)")
    p.add_argument(
        "--capacity",
        nargs="?",
        const="measure",
        metavar="RPS",
        type=_capacity_arg,
        help="measure the saturation rate first (or give it): load-relative "
        "scenarios run at load x capacity",
    )
    p.add_argument("--capacity-only", action="store_true", help="measure capacity and stop")
    p.add_argument("--capacity-duration", type=float, default=20.0)
    p.add_argument("--capacity-concurrency", type=int, default=32)
    p.add_argument("--out", type=Path, help="output folder (default .tierproxy/bench/...)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", help="model name to ask for (default: the first of /v1/models)")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=180.0,
        help="client-side bound on one request, queueing included; past it the "
        "request counts as lost",
    )
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--list-scenarios", action="store_true")
    p.add_argument(
        "--report",
        type=Path,
        metavar="RESULTS_JSON",
        help="print the tables and redraw the plots of a stored results.json",
    )
    p.add_argument(
        "--write-proxy-config",
        type=Path,
        metavar="FILE",
        help="write a proxy config holding the scenario's tenants and keys, and stop",
    )
    p.add_argument(
        "--backend",
        action="append",
        default=[],
        help="vLLM URL for --write-proxy-config (repeatable)",
    )
    p.add_argument("--proxy-port", type=int, default=8000, help="for --write-proxy-config")
    p.add_argument(
        "--max-inflight",
        type=int,
        default=6,
        help="per-backend max_inflight in the proxy config (a little above vLLM's"
        " --max-num-seqs); 0: unset, the room adapts (docs/slo.md)",
    )
    p.add_argument(
        "--early-refusal",
        action="store_true",
        help="proxy config: every tier refuses at once what would wait past its queue timeout",
    )
    p.add_argument("--max-num-seqs", type=int, default=4, help="--local: vLLM's --max-num-seqs")
    p.add_argument("--no-plugin", action="store_true", help="--local: vLLM without the plugin")
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow targets other than this machine's loopback",
    )
    return p
