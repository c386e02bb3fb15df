"""Throughput through the proxy over two engines against the two engines driven directly.

Starts two stock vLLM CPU servers (tiny model, --max-num-seqs N), then runs the same
closed-loop load (C concurrent clients, non-streaming, fixed output length) for D seconds:
  1. directly, half the clients on each engine (the best a client-side split can do);
  2. through the proxy (its own process), all clients on one URL, metering into both engines.
The two alternate for --rounds rounds, so drift in a shared machine's load hits both alike.
Prints requests/s and output tokens/s of both runs and their ratio (aim: >= 0.95).

    .venv/bin/python benchmarks/two_backends.py --duration 30 --clients 16
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from proxy.bench.stack import ProxyProcess
from proxy.bench.throughput import compare, start_proxy
from proxy.tools.engine import (
    EngineProcess,
    local_engine,
)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--no-plugin", action="store_true", help="stock vLLM, without the plugin")
    parser.add_argument("--rounds", type=int, default=2, help="direct/proxy pairs, alternated")
    args = parser.parse_args()
    engines = [
        EngineProcess(
            local_engine(index=i, max_num_seqs=args.max_num_seqs, plugin=not args.no_plugin),
            Path(f".tierproxy/logs/two-backends-{i}.log"),
        )
        for i in range(2)
    ]
    proxy: ProxyProcess | None = None
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
        urls = [e.spec.url for e in engines]
        proxy = start_proxy(urls, args.max_num_seqs, Path(".tierproxy/logs"))
        asyncio.run(compare(args, engines, proxy.url))
    finally:
        if proxy is not None:
            proxy.stop()
        for e in engines:
            e.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
