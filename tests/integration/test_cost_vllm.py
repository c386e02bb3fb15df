"""Cost and budget on real vLLM with prefix caching and ``--enable-prompt-tokens-details``: the
same ~500-token prompt twice; the second answer's prompt hits vLLM's cache, and the usage log
prices those tokens at ``cached_input``, from vLLM's own
``usage.prompt_tokens_details.cached_tokens``; the tenant's budget holds the sum of the logged
costs, and refuses (429 ``budget_exceeded``) once its worst case no longer fits."""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.bench.inproc import make_config, running_proxy
from proxy.config.tenants import hash_key
from proxy.scheduling.quotas import period
from proxy.tools.engine import EngineProcess
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import PROMPT_DETAILS

pytestmark = [pytest.mark.integration, pytest.mark.engines(PROMPT_DETAILS)]
TIMEOUT = aiohttp.ClientTimeout(total=120)
# Per million tokens: 1 per fresh prompt token, 0.1 per cached one, 4 per output token.
PRICE = {"input": 1_000_000, "cached_input": 100_000, "output": 4_000_000}
MAX_TOKENS = 8
# The first answer (~535), then ~100 each from the cache; each reserves its worst case, the
# prompt's upper bound (~800: its ~770 bytes of body) at the input price and 8 x 4 of output.
BUDGET = 1500


@pytest.fixture(scope="module")
def engine(engines: EngineFarm) -> EngineProcess:
    return engines.get(PROMPT_DETAILS)


async def test_cached_prompt_tokens_are_priced_apart_and_the_budget_holds(
    engine: EngineProcess, tmp_path: Path
) -> None:
    log = tmp_path / "usage.jsonl"
    tenant = {
        "name": "acme",
        "tier": "normal",
        "keys": [{"sha256": hash_key("key-acme")}],
        "quota": {"budget_per_day": BUDGET},
    }
    config = make_config(
        [{"url": engine.spec.url, "max_inflight": 1}],
        tenants=[tenant],
        pricing={"tiny": PRICE},
        usage_log={"path": str(log)},
    )
    prompt = f"{secrets.token_hex(8)} " + " ".join(f"word{i % 97}" for i in range(100))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    usages: list[dict[str, Any]] = []
    async with (
        running_proxy(config) as (base, state),
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
    ):
        headers = {"Authorization": "Bearer key-acme"}
        refused = None
        for _ in range(10):
            sent_at = time.time()
            async with session.post(f"{base}/v1/completions", json=body, headers=headers) as r:
                if r.status != 200:
                    refused = (r.status, r.headers.get("Retry-After"), await r.json())
                    refused_at = time.time()
                    break
                usages.append((await r.json())["usage"])
        used = state.quota_book.usage("acme", {"budget_per_day": BUDGET}, time.time())
    assert refused is not None, usages
    status, retry_after, error = refused
    assert status == 429 and error["error"]["code"] == "budget_exceeded"
    # Whole seconds to the day's end, rounded up, from the moment the proxy refused: between
    # the request's send and its answer (not the test's later time: the proxy's shutdown came
    # between, and a busy host's took seconds).
    assert retry_after is not None
    day_end = period("day", refused_at)[1]
    assert day_end - refused_at <= int(retry_after) <= day_end - sent_at + 1, retry_after
    records = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    ok = [r for r in records if r["outcome"] == "ok"]
    assert len(ok) == len(usages) >= 2
    first, second = ok[0], ok[1]
    assert first["cached_prompt_tokens"] == 0
    # vLLM reused all but the last partial block of 32 tokens.
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert second["cached_prompt_tokens"] == cached >= first["prompt_tokens"] - 32
    for rec, usage in zip(ok, usages, strict=True):
        hit = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        expected = (usage["prompt_tokens"] - hit) * 1 + hit * 0.1 + usage["completion_tokens"] * 4
        assert rec["cost"] == pytest.approx(expected)
    assert second["cost"] < first["cost"] / 3  # the same request, mostly from the cache
    # The budget holds what the log says was spent (the refusal spent nothing).
    assert used["budget_per_day"]["used"] == pytest.approx(sum(r["cost"] for r in ok))
    print(
        f"costs {[round(r['cost'], 1) for r in ok]} (cached {[r['cached_prompt_tokens'] for r in ok]}),"
        f" refused after {len(ok)} at {used['budget_per_day']['used']:.1f} of {BUDGET}"
    )
