"""How soon a proxy started beside an engine that has been up a while trusts that engine's
prefix-cache index (issue 32 item 5; docs/kv-cache.md, "Trust").

One CPU vLLM (the tiny model, prefix caching, KV events on ZMQ, no replay socket: as an engine
whose replay buffer no longer reaches back to its first batch), confined to its cores, first
sent ``--warm-requests`` prompts so that its event stream is well under way. Then, each round,
`tierproxy serve` is started in front of it (a subprocess, kv_cache on) and its /metrics is
read every 20 ms: the seconds from the spawn to /healthz answering, and to
``tierproxy_kv_index_trust`` reading 1 (partial) or more; then a prompt sent to it, and the
trust read again. ``--resync-s 30`` gives the behaviour of before (cold for 30 s).

Usage: ``python benchmarks/kv_warm_start.py [--rounds 5] [--resync-s 0]``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import orjson

from proxy.bench.hostile.served import ServedProxy, served_config
from proxy.bench.inproc import KEYS
from proxy.ops.process import free_port
from proxy.tools.engine import EngineProcess, local_engine

BLOCK = 32
TRUST = re.compile(r"^tierproxy_kv_index_trust\{[^}]*\} (\S+)$", re.M)


def _post(url: str, body: dict[str, object], key: str | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, orjson.dumps(body), headers)
    with urllib.request.urlopen(req, timeout=120) as resp:
        return int(resp.status)


def _trust(proxy: ServedProxy) -> float | None:
    try:
        with urllib.request.urlopen(proxy.admin_url + "/metrics", timeout=2) as resp:
            found = TRUST.search(resp.read().decode())
    except OSError:
        return None
    return float(found.group(1)) if found else None


def _prompt(i: int) -> dict[str, object]:
    return {
        "model": "tiny",
        "prompt": [100 + (7 * j + i) % 800 for j in range(300)],
        "max_tokens": 1,
    }


def one_round(engine: EngineProcess, workdir: Path, resync_s: float) -> tuple[float, float, float]:
    """(s to /healthz, s to trust >= 1, trust after one prompt) of one proxy started now."""
    config = served_config(
        engine.spec.url,
        kv_cache={"enabled": True, "block_size": BLOCK, "resync_s": resync_s},
        policies={"backends": "kv_aware"},
    )
    proxy = ServedProxy(config, workdir)
    spawned = time.monotonic()
    proxy.start()
    try:
        ready = time.monotonic() - spawned
        while (_trust(proxy) or 0.0) < 1.0:
            if time.monotonic() - spawned > 120:
                raise TimeoutError("the index was not trusted within 120 s")
            time.sleep(0.02)
        trusted = time.monotonic() - spawned
        _post(proxy.url + "/v1/completions", _prompt(int(trusted * 1000)), KEYS["high"])
        time.sleep(0.5)
        return ready, trusted, _trust(proxy) or 0.0
    finally:
        proxy.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--resync-s", type=float, default=0.0)
    parser.add_argument("--warm-requests", type=int, default=30)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kv-warm-start-"))
    spec = local_engine(block_size=BLOCK, kv_events_port=free_port(), max_num_seqs=4, plugin=False)
    engine = EngineProcess(spec, workdir / "vllm.log").start()
    try:
        engine.wait_ready(300.0)
        for i in range(args.warm_requests):  # up a while: its events well past batch 0
            _post(spec.url + "/v1/completions", _prompt(i))
        rows = [
            one_round(engine, workdir / f"proxy-{r}", args.resync_s) for r in range(args.rounds)
        ]
    finally:
        engine.stop()
    print(f"resync_s {args.resync_s}: {args.rounds} proxy starts beside an engine up a while")
    print("round  ready_s  trusted_s  trust_after_a_prompt")
    for r, (ready, trusted, after) in enumerate(rows):
        print(f"{r:5d}  {ready:7.2f}  {trusted:9.2f}  {after:20.0f}")
    trusted_all = [t for _, t, _ in rows]
    after_ready = [t - r for r, t, _ in rows]
    print(
        f"trusted after the spawn: median {statistics.median(trusted_all):.2f} s, max"
        f" {max(trusted_all):.2f} s; after /healthz: median {statistics.median(after_ready):.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
