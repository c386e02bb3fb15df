"""Backend choosers on a conversation scenario (docs/benchmarks.md, "Cache-aware routing"):
two stock vLLM CPU engines with small prefix caches, KV events and
--enable-prompt-tokens-details, each policy in turn through a fresh proxy, caches emptied
between runs. Prints a markdown table and writes every run's figures and records under --out.

    python benchmarks/kv_routing.py --policies least_utilised,prefix_affinity,kv_aware
    python benchmarks/kv_routing.py --shape s32007   # a shape of the family (kv-family.yaml)
    python benchmarks/kv_routing.py --shape s98014 --rounds 3 --fresh-draws  # pooled verdict
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from proxy.bench.convclient import ChatRecord
from proxy.bench.conversations import load_conversation_scenario
from proxy.bench.kvbench import (
    RunFigures,
    render,
    render_lost,
    run_dir_name,
    run_pinned,
    run_policy,
    start_engines,
)
from proxy.bench.kvplots import prefill_bars, ttft_cdfs
from proxy.bench.kvpooled import pool, render_pooled
from proxy.bench.kvsim.family import find_shape


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--scenario", default="prefix-cache")
    parser.add_argument(
        "--shape",
        help="a shape of the family (proxy/bench/scenarios/families/kv-family.yaml) by name"
        " or sSEED, with its engine count and settings; benchmarks/kv_sim.py --shape NAME"
        " simulates it",
    )
    parser.add_argument(
        "--policies",
        default="least_utilised,prefix_affinity,kv_aware",
        help="comma-separated; kv_aware@BEST/WORST sets its room weights; NAME+kv runs the"
        " KV index and the prompts' blocks under another policy (their cost alone); pinned"
        " sends each tenant straight to one fixed engine (no proxy: the reference to beat)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="every policy once per round")
    parser.add_argument(
        "--fresh-draws",
        action="store_true",
        help="each round draws the clients anew (round 1 as without it; the simulator's"
        " replica r is round r+1), and the rounds are pooled into one verdict",
    )
    parser.add_argument("--duration", type=float, help="seconds per run (default: scenario's)")
    parser.add_argument("--out", type=Path, default=Path(".tierproxy/kv-routing"))
    parser.add_argument(
        "--plots", type=Path, help="where the PNGs go (default: the run's folder; docs/img)"
    )
    args = parser.parse_args()
    if args.shape:
        scenario = find_shape(args.shape).scenario
    else:
        scenario = load_conversation_scenario(args.scenario)
    duration = args.duration or scenario.duration_s
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    out = args.out / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    engines = start_engines(scenario, out, n=scenario.engines)
    runs: list[RunFigures] = []
    try:
        urls = [e.spec.url for e in engines]
        for round_ in range(1, args.rounds + 1):
            replica = round_ - 1 if args.fresh_draws else 0
            for policy in policies:
                if policy == "pinned":
                    runs.append(run_pinned(scenario, urls, round_, out, duration, replica))
                    print(render(runs, last_only=True), file=sys.stderr)
                    continue
                # The index and the prompts' blocks run for kv_aware only (as a user would).
                wants_kv = policy.startswith("kv_aware") or policy.endswith("+kv")
                tokenizer = engines[0].spec.model if wants_kv else None
                runs.append(
                    run_policy(scenario, urls, policy, round_, out, duration, tokenizer, replica)
                )
                print(render(runs, last_only=True), file=sys.stderr)
    finally:
        for e in engines:
            e.stop()
    (out / "figures.json").write_text(json.dumps([asdict(r) for r in runs], indent=1))
    plots = args.plots or out
    plots.mkdir(parents=True, exist_ok=True)
    prefill_bars(runs, plots / "kv-routing-prefill.png")
    last = max(r.round for r in runs)
    dirs = {r.policy: out / run_dir_name(r.policy, last) for r in runs if r.round == last}
    tiers = list(dict.fromkeys(t.tier for t in scenario.tenants))
    ttft_cdfs(dirs, tiers, plots / "kv-routing-ttft.png")
    print(f"scenario {scenario.name}, {duration:.0f} s per run; {out}")
    print(render(runs))
    print()
    print(render_lost(runs))
    if args.fresh_draws and args.rounds > 1:  # rounds of one draw are not a larger sample
        records = {
            (r.policy, r.round): _records(out / run_dir_name(r.policy, r.round)) for r in runs
        }
        print()
        print(render_pooled(pool(runs, records)))
    return 0


def _records(run_dir: Path) -> list[ChatRecord]:
    return [ChatRecord(**r) for r in json.loads((run_dir / "records.json").read_text())]


if __name__ == "__main__":
    sys.exit(main())
