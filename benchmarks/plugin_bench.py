"""Stock vLLM vs vLLM with the tierproxy plugin, side by side (CPU build, tiny model by default).

    .venv/bin/python benchmarks/plugin_bench.py [--repeats 3]
    .venv/bin/python benchmarks/plugin_bench.py --stock-url http://h:8001 --plugin-url http://h:8002

Without URLs it starts both engines itself (same flags, see
proxy.bench.plugin.requests.ENGINE_ARGS; the plugin one adds --middleware / --scheduler-cls)
one after the other, and stops them. Figures:

- TTFT of a high-tier request arriving while 4 long low-tier generations fill --max-num-seqs 4
  (queued to first token, engine clock), and whether the low-tier requests still completed;
- high-tier inter-token latency p50 / p99 (vLLM's ITL histogram) while 4000-token low-tier
  prompts keep arriving, and the number of ITL samples in the window;
- forged / unsigned priority claims (forged ticket, body ``priority: -1000``,
  ``X-Vllm-Priority: -1000``, unsigned ``vllm_xargs``) sent beside 4 running low-tier requests:
  how long they queued (engine clock) against a signed high-tier request, and preemptions;
- two low-tier requests whose deadline passes while they wait behind 4 running ones: how they
  ended and how many tokens they produced.

Stock vLLM has no tickets: there the "signed high-tier" control is an ordinary request, the
attacks' priority claims are honoured, and deadlines mean nothing (the requests run late).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from proxy.bench.plugin.compare import report, run_on


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
