"""Per-request cost of a prompt's KV-cache blocks on the proxy's side (kv_cache on): the chat
template rendered, the prompt tokenized, its blocks hashed (proxy.request.prompt_blocks), in µs,
p50 / p99, by prompt size; and the cost for a config with kv_cache off (the call returns at once).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/prompt_blocks_cost.py [--model DIR] [--n 2000]
    ... --remote http://127.0.0.1:8100   # also through that vLLM's POST /tokenize (no tokenizer)
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import time
from pathlib import Path
from typing import Any

from proxy.config.loader import load_config
from proxy.policies.blockhash import chain_hashes
from proxy.request.inbound import ParsedRequest
from proxy.request.prompt_blocks import (
    ModelTokenizer,
    PromptBlocks,
    prompt_block_hashes,
    prompt_tokens,
)
from proxy.request.tokencache import VERIFY

SALT = "x" * 43  # the proxy's salts are 43 characters (base64 of an HMAC)


def chat(system_words: int, turns: int, seed: str) -> list[dict[str, str]]:
    words = " ".join(f"word{i % 113}" for i in range(system_words))
    messages = [{"role": "system", "content": f"{seed} {words}"}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn} " + "why not " * 20})
        messages.append({"role": "assistant", "content": f"answer {turn} " + "because " * 40})
    return [*messages, {"role": "user", "content": f"and now, {seed}?"}]


def parsed(body: dict[str, Any], endpoint: str = "chat") -> ParsedRequest:
    return ParsedRequest(body, endpoint, False, "tiny", 0, 16, 16, False)  # type: ignore[arg-type]


def as_chat(messages: list[dict[str, str]]) -> ParsedRequest:
    return parsed({"model": "tiny", "messages": messages})


def percentiles(samples: list[float]) -> tuple[float, float]:
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(len(samples) * 0.99))]


def timed(model: ModelTokenizer, request: ParsedRequest) -> tuple[float, float, int]:
    """(µs for the blocks, µs of that for hashing alone, tokens)."""
    t0 = time.perf_counter_ns()
    prompt_block_hashes(model, request, 32, SALT)
    t1 = time.perf_counter_ns()
    tokens = prompt_tokens(model, request) or []
    t2 = time.perf_counter_ns()
    chain_hashes(tokens[:-1], 32, SALT)
    t3 = time.perf_counter_ns()
    return (t1 - t0) / 1000, (t3 - t2) / 1000, len(tokens)


def case(model: ModelTokenizer, n: int, make: Any, before: Any = None) -> dict[str, float]:
    """``make(i)``: the i-th request, timed; ``before(i)``: one sent first, untimed (the same
    conversation's previous turn)."""
    total: list[float] = []
    hashing: list[float] = []
    count = 0
    for i in range(n):
        if before is not None:
            prompt_block_hashes(model, before(i), 32, SALT)
        us, hash_us, count = timed(model, make(i))
        total.append(us)
        hashing.append(hash_us)
    p50, p99 = percentiles(total)
    h50, h99 = percentiles(hashing)
    return {"tokens": count, "p50": p50, "p99": p99, "hash_p50": h50, "hash_p99": h99}


async def remote_cost(url: str, n: int, system_words: int) -> tuple[float, float, int]:
    """µs p50 / p99 of the blocks through a backend's /tokenize, one call at a time."""
    import aiohttp

    from proxy.backends.pool import BackendPool
    from proxy.config.backends import Backend, BackendHealth
    from proxy.config.kv_cache import KvCache
    from proxy.policies.backends import LeastUtilised
    from proxy.request.remote_tokens import RemoteTokenizer

    pool = BackendPool([Backend(url=url)], BackendHealth(), LeastUtilised())
    remote, kv = RemoteTokenizer(), KvCache(tokenize_timeout_s=5.0)
    samples: list[float] = []
    count = 0
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            request = as_chat(chat(system_words, 0, secrets.token_hex(4)))
            t0 = time.perf_counter_ns()
            tokens = await remote.tokens(request, kv, pool, session, 0.0)
            blocks = chain_hashes((tokens or [])[:-1], 32, SALT)
            samples.append((time.perf_counter_ns() - t0) / 1000)
            assert tokens, "no tokens from /tokenize"
            count = len(tokens)
            del blocks
    p50, p99 = percentiles(samples)
    return p50, p99, count


async def off_cost(n: int) -> tuple[float, float]:
    config = load_config("configs/example.yaml").config  # kv_cache off: the default
    blocks = PromptBlocks()
    request = as_chat(chat(200, 2, "x"))
    samples: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        await blocks.compute(config, request, SALT)
        samples.append((time.perf_counter_ns() - t0) / 1000)
    return percentiles(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".tierproxy/tiny-model")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--remote", help="a vLLM base URL: also time its /tokenize")
    args = ap.parse_args()
    model = ModelTokenizer(Path(args.model))
    n = args.n
    for i in range(VERIFY):  # its first cuts are verified by a second, whole encode
        prompt_block_hashes(model, as_chat(chat(50, 1, f"warm{i}")), 32, SALT)
    text = " ".join(f"w{i % 97}" for i in range(4000))
    cases = {
        "chat, 100-word system, first turn": case(
            model, n, lambda i: as_chat(chat(100, 0, secrets.token_hex(4)))
        ),
        "chat, 1500-word system, first turn": case(
            model, n, lambda i: as_chat(chat(1500, 0, secrets.token_hex(4)))
        ),
        "chat, 1500-word system, turn 10 (9 seen)": case(
            model,
            n,
            lambda i: as_chat(chat(1500, 9, f"s{i}")),
            # Its previous turn: the same conversation without the last answer and question.
            before=lambda i: as_chat(chat(1500, 9, f"s{i}")[:-2]),
        ),
        "completion, 4,000 words": case(
            model,
            n,
            lambda i: parsed({"prompt": f"{secrets.token_hex(4)} {text}"}, "completions"),
        ),
    }
    print(
        f"{'prompt':42} {'tokens':>7} {'p50 µs':>8} {'p99 µs':>8} {'hash p50':>9} {'hash p99':>9}"
    )
    for name, r in cases.items():
        print(
            f"{name:42} {r['tokens']:7.0f} {r['p50']:8.0f} {r['p99']:8.0f}"
            f" {r['hash_p50']:9.0f} {r['hash_p99']:9.0f}"
        )
    if args.remote:
        for words in (100, 1500):
            p50, p99, count = asyncio.run(remote_cost(args.remote, n, words))
            name = f"via /tokenize, {words}-word system"
            print(f"{name:42} {count:7d} {p50:8.0f} {p99:8.0f}")
    p50, p99 = asyncio.run(off_cost(args.n))
    print(f"kv_cache off (default config): p50 {p50:.2f} µs, p99 {p99:.2f} µs")


if __name__ == "__main__":
    main()
