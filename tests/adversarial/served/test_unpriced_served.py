"""What a request without ``model`` costs, against `tierproxy serve` (issue 30): vLLM runs its
default model for it, so the proxy bills it as that model (the backend's first ``/v1/models``
card), and a budget with no price at all refuses rather than serve for free. The in-process
twin: tests/unit/request/test_billing.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson

from proxy.bench.hostile.kit import exchange, json_request, request_bytes
from proxy.bench.hostile.served import ServedProxy, StartServed
from proxy.bench.inproc import KEYS
from proxy.config.tenants import hash_key

# The fake backend (model "null") answers 4 prompt and 4 output tokens: 4 + 400 = 404 a request.
PRICING = {"null": {"input": 1_000_000, "output": 100_000_000}}
BUDGET = 2000.0


def budgeted(**extra: Any) -> dict[str, Any]:
    tenant = {"name": "tenant-normal", "tier": "normal", "quota": {"budget_per_day": BUDGET}}
    return {"tenants": [{**tenant, "keys": [{"sha256": hash_key(KEYS["normal"])}]}], **extra}


async def models_known(proxy: ServedProxy) -> None:
    """Until the proxy's models probe has read the backend's cards (its /v1/models lists them)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        headers = {"Authorization": f"Bearer {KEYS['normal']}"}
        answer = await exchange(
            proxy.host, proxy.port, request_bytes("GET", "/v1/models", headers, b"")
        )
        if answer.status == 200 and b'"null"' in answer.body:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the proxy never listed the backend's model")


def chat(**extra: object) -> bytes:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    return json_request("/v1/chat/completions", body, KEYS["normal"])


async def test_requests_without_model_spend_the_budget(
    start_served: StartServed, tmp_path: Path
) -> None:
    # Before: 20 of 20 served past the budget, cost null in the usage log.
    log = tmp_path / "usage.jsonl"
    proxy = start_served(**budgeted(pricing=PRICING, usage_log={"path": str(log)}))
    await models_known(proxy)
    statuses = []
    for extra in ({}, {"model": None}) * 10:
        answer = await exchange(proxy.host, proxy.port, chat(**extra))
        statuses.append(answer.status)
        if answer.status != 200:
            assert answer.status == 429 and b"budget_exceeded" in answer.body
    assert 0 < statuses.count(200) <= 5  # 404 each; the next's worst case must fit in 2,000
    deadline = time.monotonic() + 10
    while len(log.read_text().splitlines() if log.exists() else []) < len(statuses):
        assert time.monotonic() < deadline, "usage log incomplete"
        await asyncio.sleep(0.05)
    records = [orjson.loads(line) for line in log.read_text().splitlines()]
    served = [r for r in records if r["outcome"] == "ok"]
    assert all(r["model"] == "null" and r["cost"] == 404 for r in served)
    assert proxy.tracebacks() == 0


async def test_a_budget_without_a_price_is_refused_not_free(start_served: StartServed) -> None:
    proxy = start_served(**budgeted(pricing={"other": {"input": 1, "output": 1}}))
    await models_known(proxy)
    for extra in ({}, {"model": "null"}):
        answer = await exchange(proxy.host, proxy.port, chat(**extra))
        assert answer.status == 400 and b"model_not_priced" in answer.body
