"""x-ratelimit-* on streams (issue #25 item 5), through `tierproxy serve`: a stream's headers
leave with its first event, so they carry the tenant's windows as they stood at admission. With
shared state the admitting Lua script hands back the global levels (no extra round trip), so a
stream admitted by one replica tells what the other replicas took too; without Redis, this
process's own buckets."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import Response, exchange, json_request
from proxy.bench.hostile.served import NullBackend
from proxy.bench.inproc import KEYS

BODY = {
    "model": "null",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 16,
    "stream": True,
}
RPM, TPM = 6, 100_000  # a request refills in 10 s: none does between these


@pytest.fixture
def backend() -> Iterator[NullBackend]:
    with NullBackend(FakeVLLM(model="null", usage=(4, 4))) as upstream:
        yield upstream


async def stream(proxy: Any, body: dict[str, Any] = BODY) -> Response:
    answer = await exchange(
        proxy.host, proxy.port, json_request("/v1/chat/completions", body, KEYS["normal"])
    )
    assert answer.status == 200, answer.body
    return answer


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "local"])
async def test_a_stream_carries_its_admission_windows(start: Any, shared: bool) -> None:
    proxy = start(shared=shared, requests_per_minute=RPM, tokens_per_minute=TPM)
    first = await stream(proxy)
    assert first.headers["content-type"].startswith("text/event-stream")
    assert b"data: [DONE]" in first.body
    h = first.headers
    assert h["x-ratelimit-limit-requests"] == str(RPM)
    assert h["x-ratelimit-remaining-requests"] == str(RPM - 1)
    assert h["x-ratelimit-reset-requests"] == "10s"  # one request's worth refills in 10 s
    assert h["x-ratelimit-limit-tokens"] == str(TPM)
    # Its reservation (prompt estimate + max_tokens 16) taken: between 16 and 100 tokens.
    taken = TPM - int(h["x-ratelimit-remaining-tokens"])
    assert 16 <= taken < 100, h
    second = await stream(proxy)
    assert second.headers["x-ratelimit-remaining-requests"] == str(RPM - 2)


async def test_a_second_replicas_stream_sees_the_global_window(start: Any) -> None:
    a = start(requests_per_minute=RPM, tokens_per_minute=TPM)
    b = start(requests_per_minute=RPM, tokens_per_minute=TPM)
    for _ in range(3):
        await stream(a)
    answer = await stream(b)
    assert answer.headers["x-ratelimit-remaining-requests"] == str(RPM - 4)


async def test_a_buffered_answer_has_them_with_shared_state_too(start: Any) -> None:
    # Before, with Redis deciding, no answer carried them (reading the levels back cost a trip).
    proxy = start(requests_per_minute=RPM)
    answer = await stream(proxy, {**BODY, "stream": False})
    assert answer.headers["x-ratelimit-remaining-requests"] == str(RPM - 1)
    assert "x-ratelimit-limit-tokens" not in answer.headers  # no token limit: no such headers
