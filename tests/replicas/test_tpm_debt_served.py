"""One answer far past its reservation, through `tierproxy serve` with shared state in a real
redis-server: the tenant owes at most one minute of its token limit (as without Redis), not
hours (a Retry-After of 940 s was seen)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import exchange, json_request
from proxy.bench.hostile.served import NullBackend
from proxy.bench.inproc import KEYS

HUGE = 200_000  # total_tokens the backend reports for the answer


@pytest.fixture
def backend() -> Iterator[NullBackend]:
    with NullBackend(FakeVLLM(model="null", usage=(10, HUGE - 10))) as upstream:
        yield upstream


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "local"])
async def test_one_huge_answer_costs_at_most_a_minute(start: Any, shared: bool) -> None:
    proxy = start(shared=shared, tokens_per_minute=12_000)  # 200 tokens/s
    body = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    request = json_request("/v1/chat/completions", body, KEYS["normal"])
    first = await exchange(proxy.host, proxy.port, request)
    assert first.status == 200, first.body
    refused = None
    for _ in range(50):  # the settle reaches Redis just after the answer
        answer = await exchange(proxy.host, proxy.port, request)
        if answer.status == 429:
            refused = answer
            break
    assert refused is not None and refused.error_code() == "rate_limit_exceeded"
    # The floor is -12,000: the next request waits one minute plus its own tokens' worth.
    assert 55 <= int(refused.headers["retry-after"]) <= 62, refused.headers
