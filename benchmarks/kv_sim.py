"""Backend choosers across the family of conversation workloads, simulated (issue 32;
docs/benchmarks.md, "Cache-aware routing across a family of workloads"): each shape of
proxy/bench/scenarios/families/kv-family.yaml through the proxy's real scheduling and choosers
in front of simulated vLLM engines, on a simulated clock. Prints the family table and a
summary.

    python benchmarks/kv_sim.py                     # the whole family (minutes)
    python benchmarks/kv_sim.py --shape s32007      # one shape, every figure
    python benchmarks/kv_sim.py --seed 77 --shapes 3  # shapes drawn by another seed
    python benchmarks/kv_sim.py --shape s91001 --costs busy  # engines as slow as beside the suite
"""

from __future__ import annotations

import argparse
import sys
import time

from proxy.bench.kvsim.engine import COSTS, EngineCosts
from proxy.bench.kvsim.family import Shape, find_shape, load_family
from proxy.bench.kvsim.report import (
    BASELINES,
    Figures,
    figures,
    render_summary,
    render_table,
    replicas_for,
)
from proxy.bench.kvsim.run import simulate


def run_shape(
    shape: Shape, policies: list[str], costs: EngineCosts, replicas: int | None = None
) -> dict[str, Figures]:
    """Each policy's figures on ``shape``, pooled over ``replicas`` runs (None: as many as
    its best tier's tail needs, ``replicas_for``)."""
    duration = shape.scenario.duration_s
    runs = {p: [simulate(shape.scenario, p, costs=costs)] for p in policies}
    first = {p: figures(r, duration) for p, r in runs.items()}
    wanted = replicas_for(first) if replicas is None else replicas
    for p, r in runs.items():
        r += [simulate(shape.scenario, p, costs=costs, replica=i) for i in range(1, wanted)]
    return {p: figures(r, duration) for p, r in runs.items()}


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
        runs = run_shape(shape, policies, costs, args.replicas)
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
    started = time.process_time()
    for shape in family:
        rows.append((shape.name, run_shape(shape, policies, costs, args.replicas)))
        print(render_table(rows[-1:], args.kv).splitlines()[-1], file=sys.stderr)
    print(render_table(rows, args.kv))
    print()
    print(render_summary(rows, args.kv))
    cpu = time.process_time() - started
    print(f"({len(rows)} shapes x {len(policies)} policies, {cpu:.0f} s CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
