"""The prompt-cache timing probe (docs/isolation.md): does tenant B's time to first token tell
it that tenant A just sent the same prompt?

One CPU vLLM (tiny model, ``--enable-prefix-caching --block-size 32``, the plugin, confined to
its cores) and the proxy in process. Each round takes a fresh ~2,000-token prompt and times a
one-token completion (its latency is the prefill: TTFT) for:

- ``cold``: A's first send;
- ``B after A, proxy``: B sends it through the proxy, which salts each tenant apart;
- ``A again, proxy``: A repeats it (its own cache: a hit, as it should be);
- ``B after A, no salt``: the same pair sent straight to vLLM without a salt, as every request
  was sent before the salt (the leak).

Usage: ``python benchmarks/cache_probe.py [--rounds 15]``; prints medians and p10/p90 in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from proxy.bench.inproc import SECRET, auth, make_config, running_proxy
from proxy.tools.engine import EngineProcess, local_engine

ARGS = ("--enable-prefix-caching", "--block-size", "32")


def prompt() -> str:
    return secrets.token_hex(8) + " " + " ".join(f"w{i % 89}" for i in range(700))


PROMPT_TOKENS: list[int] = []


async def timed(session: aiohttp.ClientSession, url: str, headers: dict[str, str], p: str) -> float:
    body = {"model": "tiny", "prompt": p, "max_tokens": 1}
    start = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
    PROMPT_TOKENS.append(answer["usage"]["prompt_tokens"])
    return (time.perf_counter() - start) * 1000


def line(name: str, values: list[float]) -> str:
    q = statistics.quantiles(values, n=10)
    return (
        f"  {name:22} median {statistics.median(values):7.1f} ms  p10 {q[0]:7.1f}  p90 {q[-1]:7.1f}"
    )


async def run(engine_url: str, rounds: int) -> None:
    results: dict[str, list[float]] = {
        k: [] for k in ("cold", "B after A, proxy", "A again, proxy", "B after A, no salt")
    }
    config = make_config([{"url": engine_url, "max_inflight": 1}])
    async with running_proxy(config) as (base, _), aiohttp.ClientSession() as s:
        for _ in range(3):  # warm-up
            await timed(s, base, auth("high"), prompt())
        for _ in range(rounds):
            p = prompt()
            results["cold"].append(await timed(s, base, auth("high"), p))
            results["B after A, proxy"].append(await timed(s, base, auth("normal"), p))
            results["A again, proxy"].append(await timed(s, base, auth("high"), p))
            q = prompt()
            await timed(s, engine_url, {}, q)  # "A", unsalted
            results["B after A, no salt"].append(await timed(s, engine_url, {}, q))
    tokens = statistics.median(PROMPT_TOKENS)
    print(f"one-token completions of a {tokens:.0f}-token prompt, {rounds} rounds:")
    for name, values in results.items():
        print(line(name, values))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    spec = local_engine(
        max_num_seqs=2,
        max_model_len=4096,
        extra_args=ARGS,
        env={"TIERPROXY_TICKET_SECRET": SECRET.decode()},
    )
    log = Path(tempfile.mkdtemp(prefix="cache-probe-")) / "vllm.log"
    engine = EngineProcess(spec, log).start()
    try:
        engine.wait_ready(300.0)
        asyncio.run(run(spec.url, args.rounds))
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
