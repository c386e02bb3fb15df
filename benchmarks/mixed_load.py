"""The mixed-load benchmark (`make bench`): one local vLLM, the proxy in front of it, the same
mixed load through the proxy and directly against vLLM.

Starts a stock vLLM CPU server with the tiny model and --max-num-seqs 4 (so that it saturates),
writes a proxy config holding the scenario's tenants, starts `tierproxy serve` on it, measures
the capacity, then runs the scenario (default: overload-2x, 30 s) through the proxy and directly.
Prints per tier and tenant TTFT / ITL / end-to-end p50-p99, throughput, goodput and counts by
outcome (ok, 429, 503, 504, error, lost), then both runs side by side; writes results.json and
plots under .tierproxy/bench/mixed_load/. Every `tierproxy bench` option can be appended:

    python benchmarks/mixed_load.py --scenario fairness --duration 40
"""

from __future__ import annotations

import sys

from proxy.bench.cli import main

DEFAULTS = [
    "--local",
    "--scenario",
    "overload-2x",
    "--duration",
    "30",
    "--out",
    ".tierproxy/bench/mixed_load",
]

if __name__ == "__main__":
    sys.exit(main(DEFAULTS + sys.argv[1:]))
