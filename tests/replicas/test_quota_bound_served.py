"""Quotas through `tierproxy serve`, with and without shared state in a real redis-server: a
concurrent burst of CJK prompts (~3 tokens a character, 12x their chars/4 estimate) passes a
day quota by at most about one request (fresh eyes q01: it passed it 9 times over)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import exchange, json_request
from proxy.bench.hostile.served import NullBackend
from proxy.bench.inproc import KEYS

REAL = (60_000, 10)  # the tokens the backend reports for each prompt below
LIMIT = 200_000
BODY = {
    "model": "null",
    "messages": [{"role": "user", "content": "\u4e00\u4e01" * 10_000}],
    "max_tokens": 10,
}


@pytest.fixture
def backend() -> Iterator[NullBackend]:
    # Slow enough that the whole burst reserves before the first answer settles.
    with NullBackend(FakeVLLM(model="null", usage=REAL, delay_s=1.0)) as upstream:
        yield upstream


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "local"])
async def test_a_cjk_burst_passes_the_day_quota_by_one_request_at_most(
    start: Any, backend: NullBackend, shared: bool
) -> None:
    proxy = start(shared=shared, quota={"tokens_per_day": LIMIT})
    request = json_request("/v1/chat/completions", BODY, KEYS["normal"])
    answers = await asyncio.gather(*(exchange(proxy.host, proxy.port, request) for _ in range(30)))
    statuses = [a.status for a in answers]
    admitted = statuses.count(200)
    assert admitted + statuses.count(429) == 30, statuses
    # Before: all 30 admitted, 1,800,300 tokens billed. Now: the bound's 3 fit (3 x ~60,000).
    assert admitted > 0 and admitted * sum(REAL) <= LIMIT + sum(REAL), statuses
    assert backend.null.served == admitted
