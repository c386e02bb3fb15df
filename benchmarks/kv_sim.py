"""Backend choosers across the family of conversation workloads, simulated (issue 32;
docs/benchmarks.md, "Cache-aware routing across a family of workloads"): each shape of
proxy/bench/scenarios/families/kv-family.yaml through the proxy's real scheduling and choosers
in front of simulated vLLM engines, on a simulated clock. Prints the family table and a
summary.

    python benchmarks/kv_sim.py                     # the whole family (minutes)
    python benchmarks/kv_sim.py --shape s32007      # one shape, every figure
    python benchmarks/kv_sim.py --seed 77 --shapes 3  # shapes drawn by another seed
    python benchmarks/kv_sim.py --shape s91001 --costs busy  # engines as slow as beside the suite
    python benchmarks/kv_sim.py --samples 2         # each shape on two independent draws
"""

from __future__ import annotations

import argparse
import sys
import time

from proxy.bench.kvsim.engine import COSTS, EngineCosts
from proxy.bench.kvsim.family import find_shape, load_family
from proxy.bench.kvsim.report import (
    BASELINES,
    Figures,
    render_agreement,
    render_summary,
    render_table,
)
from proxy.bench.kvsim.samples import run_samples


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--shape", help="one shape by name (sSEED or its full name)")
    parser.add_argument("--seed", type=int, help="draw the family from another seed")
    parser.add_argument("--shapes", type=int, help="only the first N shapes")
    parser.add_argument(
        "--kv", default="kv_aware", help="the policy judged (kv_aware@BEST/WORST/HOLD/WORK)"
    )
    parser.add_argument(
        "--costs",
        default="quiet",
        help="the engines' speed: quiet (one core to itself), busy (beside the test suite),"
        " or STEP,PREFILL_TOKEN,DECODE_SEQ in seconds",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=1,
        help="independent samples per shape, each judged alone, then all pooled: how often"
        " a shape's verdict is the same on another draw of its clients",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        help="runs pooled per shape (default: enough for 200 first tokens of the best tier,"
        " at most 10; 1: the real client's draw alone, as kv_routing.py sends it)",
    )
    args = parser.parse_args()
    costs = COSTS.get(args.costs) or EngineCosts(*(float(x) for x in args.costs.split(",")))
    policies = [*BASELINES, args.kv]
    if args.shape:
        shape = find_shape(args.shape)
        runs = run_samples(
            shape.scenario, policies, costs, replicas=args.replicas, samples=args.samples
        )[-1]
        print(
            f"{shape.name}: working set {shape.working_set_blocks} blocks,"
            f" cache ratio {shape.cache_ratio:.2f}, {shape.scenario.engines} engines of"
            f" {shape.scenario.engine.kv_blocks} blocks, {costs}"
        )
        for f in runs.values():
            print(f"  {f}")
        print(render_table([(shape.name, runs)], args.kv))
        return 0
    family = load_family(seed=args.seed)[: args.shapes]
    rows = []
    per_sample: list[list[tuple[str, dict[str, Figures]]]] = [[] for _ in range(args.samples)]
    started = time.process_time()
    for shape in family:
        *each, pooled = run_samples(
            shape.scenario, policies, costs, replicas=args.replicas, samples=args.samples
        )
        for j, runs in enumerate(each):
            per_sample[j].append((shape.name, runs))
            line = render_table(per_sample[j][-1:], args.kv).splitlines()[-1]
            print(f"sample {j + 1}: {line}", file=sys.stderr)
        rows.append((shape.name, pooled))
        print(render_table(rows[-1:], args.kv).splitlines()[-1], file=sys.stderr)
    print(render_table(rows, args.kv))
    print()
    if args.samples > 1:
        for j, sample in enumerate(per_sample):
            print(f"sample {j + 1} alone: " + render_summary(sample, args.kv).splitlines()[0])
        print(render_agreement(per_sample, args.kv))
        print("all samples pooled:")
    print(render_summary(rows, args.kv))
    cpu = time.process_time() - started
    print(f"({len(rows)} shapes x {len(policies)} policies, {cpu:.0f} s CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
