"""What a tenant's body may carry to vLLM, and what it reserves, against `tierproxy serve`
(issue 30, "Why" bullets 1 and 5; issue 31's Responses timing): a 7 MB ``session_id`` never
reaches the backend, ``request_id`` on /v1/responses is the proxy's, an unknown big field is
refused, 80 KB under a tool parameter named ``file`` and 100,000 empty embedding inputs are
reserved at their size, and a Responses request's engine time is logged. In-process twins:
tests/unit/request/test_route_table.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import exchange, json_request
from proxy.bench.hostile.served import NullBackend, StartServed
from proxy.bench.inproc import KEYS
from proxy.config.tenants import hash_key
from tests.helpers.served_logs import usage_records, wait_for

ENGINE_S = 0.4  # each answer takes this long at the fake backend


@pytest.fixture(scope="module")
def backend() -> Iterator[NullBackend]:
    with NullBackend(FakeVLLM(delay_s=ENGINE_S)) as upstream:
        yield upstream


def quota_tenants(tokens_per_day: int) -> list[dict[str, object]]:
    return [
        {
            "name": "tenant-normal",
            "tier": "normal",
            "quota": {"tokens_per_day": tokens_per_day},
            "keys": [{"sha256": hash_key(KEYS["normal"])}],
        }
    ]


async def test_a_huge_session_id_never_reaches_the_backend(
    start_served: StartServed, backend: NullBackend
) -> None:
    # Before: the 7 MB session_id reached vLLM as sent (into every KV event it publishes).
    proxy = start_served(limits={"max_body_bytes": 8 * 1024 * 1024})
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    request = json_request("/v1/chat/completions", {**body, "session_id": "s" * 7_000_000},
                           KEYS["normal"])  # fmt: skip
    answer = await exchange(proxy.host, proxy.port, request, timeout_s=30)
    assert answer.status == 200
    sent = backend.null.received[-1]
    assert sent.path == "/v1/chat/completions" and "session_id" not in sent.body


async def test_responses_request_id_is_the_proxys_not_the_clients(
    start_served: StartServed, backend: NullBackend, tmp_path: Path
) -> None:
    # Before: vLLM got the client's request_id (its own id on /v1/responses), and the usage
    # log said engine_s 0.0 (the Responses relay bypassed the timed one).
    log = tmp_path / "usage.jsonl"
    proxy = start_served(usage_log={"path": str(log)})
    body = {"model": "tiny", "input": "hi", "store": False, "request_id": "client-chosen"}
    answer = await exchange(proxy.host, proxy.port, json_request("/v1/responses", body,
                                                                 KEYS["normal"]))  # fmt: skip
    assert answer.status == 200
    sent = backend.null.received[-1]
    assert sent.body["request_id"] != "client-chosen"
    assert sent.body["request_id"] == sent.headers["X-Request-Id"]
    await wait_for(lambda: len(usage_records(log)) == 1, 10, "the usage-log line")
    (record,) = usage_records(log)
    assert record["engine_s"] >= ENGINE_S * 0.9 and record["queue_s"] < record["engine_s"]


async def test_an_unknown_big_field_is_refused(
    start_served: StartServed, backend: NullBackend
) -> None:
    # Before: passed on to vLLM as sent, whatever its size.
    proxy = start_served()
    before = len(backend.null.received)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "blob": {"x": "y" * 100_000}}
    answer = await exchange(proxy.host, proxy.port, json_request("/v1/completions", body,
                                                                 KEYS["normal"]))  # fmt: skip
    assert answer.status == 400 and answer.error_code() == "unknown_field"
    assert b"blob" in answer.body and len(backend.null.received) == before


async def burst(start_served: StartServed, path: str, body: dict[str, object]) -> list[int]:
    proxy = start_served(tenants=quota_tenants(200_000))
    request = json_request(path, body, KEYS["normal"])
    answers = await asyncio.gather(
        *(exchange(proxy.host, proxy.port, request, timeout_s=30) for _ in range(30))
    )
    return [a.status for a in answers]


async def test_a_tool_schema_under_file_is_reserved_at_its_size(
    start_served: StartServed,
) -> None:
    # Before: 30 of 30 admitted against tokens_per_day 200,000 (the subtree under "file" was
    # counted 0). Each reserves ~80,000 now: at most 2 at once.
    schema = {"type": "object", "properties": {"file": {"description": "x" * 80_000}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
            "max_tokens": 3}  # fmt: skip
    statuses = await burst(start_served, "/v1/chat/completions", body)
    assert statuses.count(200) <= 2 and statuses.count(429) >= 28, statuses


async def test_empty_embedding_inputs_are_reserved_at_their_size(
    start_served: StartServed,
) -> None:
    # Before: a bound of 32 tokens for 100,000 empty inputs: all 30 admitted.
    statuses = await burst(
        start_served, "/v1/embeddings", {"model": "tiny", "input": [""] * 100_000}
    )
    assert statuses.count(200) <= 1 and statuses.count(429) >= 29, statuses
