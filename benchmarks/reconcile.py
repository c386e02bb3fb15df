"""Reconciliation against real vLLM (issue 30 item 6; docs/quotas.md "Reconciliation").

One CPU vLLM engine (the tiny model, confined to the engine cores like the suite's) behind
`tierproxy serve` with a usage log and three tenants with quotas and budgets (two run out), a
hostile mix in categories (plain chat; streams the client cuts at random points; n > 1;
answers near and past relay.max_response_bytes from echo + top-20 logprobs + prompt_logprobs;
tools; requests without model): what the usage log and the quota counters billed against
vLLM's own vllm:prompt_tokens_total and vllm:generation_tokens_total, per category; then the
same with shared_state in a local redis-server stalled past call_timeout_s and restarted.

    python benchmarks/reconcile.py [--per-category 24] [--engine URL] [--only local|redis]

Embeddings are left out: the tiny model is a causal LM and its generate engine answers
/v1/embeddings with 404 (a pooling engine would be a second engine).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from proxy.bench.reconcile.run import Settings, reconcile
from proxy.tools.engine import EngineProcess, local_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-category", type=int, default=24)
    parser.add_argument("--engine", help="a running vLLM serving 'tiny' (default: start one)")
    parser.add_argument("--only", choices=("local", "redis"))
    parser.add_argument("--seed", type=int, default=30)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="reconcile-"))
    engine = None
    url = args.engine
    if url is None:
        spec = local_engine(max_num_seqs=4, plugin=False)  # the suite's CORE engine
        engine = EngineProcess(spec, workdir / "engine.log").start()
        engine.wait_ready()
        url = spec.url
    scale = args.per_category / 9  # the quotas grow with the run: tenants still run out
    try:
        for mode in ("local", "redis"):
            if args.only not in (None, mode):
                continue
            settings = Settings(
                per_category=args.per_category,
                seed=args.seed,
                redis=mode == "redis",
                scale=scale,
            )
            result = asyncio.run(reconcile(url, workdir / mode, settings))
            print(f"\n== {mode} (per category {args.per_category}, seed {args.seed})")
            print(result.table())
            print(
                f"billed/engine: prompt {result.prompt_ratio():.3f}, output"
                f" {result.output_ratio():.3f}, counters {result.counter_ratio():.3f};"
                f" counters past quota + one worst case: {len(result.counters_over())}"
            )
    finally:
        if engine is not None:
            engine.stop()
    print(f"\nlogs: {workdir}")


if __name__ == "__main__":
    main()
