"""Bill what the engine ran (issue 30, "Why" bullets 3 and 4), against `tierproxy serve` and the
fake vLLM (proxy.bench.fake_vllm: multi-token chunks, a stream cut before its usage chunk, an
answer past ``relay.max_response_bytes`` with its usage at the end). Every meter must agree:
the usage log's line and the tenant's day quota (what /admin/status shows). The in-process
twins: tests/unit/request/test_engine_ran_billing.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import exchange, json_request
from proxy.bench.hostile.served import ADMIN_KEY, NullBackend, ServedProxy, StartServed
from proxy.bench.inproc import KEYS
from tests.helpers.served_logs import usage_records, wait_for

CHUNKS, PER_CHUNK = 152, 50  # 7,600 tokens in 152 chunks: billed 149 before
QUOTA = {"tokens_per_day": 10_000_000}
ENGINE_USAGE = (100, 30_000)  # what the fake engine computed for an oversize answer


@pytest.fixture(scope="module")
def backend() -> Iterator[NullBackend]:
    with NullBackend(FakeVLLM(model="tiny")) as upstream:
        yield upstream


@pytest.fixture
def fake(backend: NullBackend) -> Iterator[FakeVLLM]:
    """The module's fake engine, set by each test and put back after it."""
    null = backend.null
    yield null
    null.stream_chunks, null.chunk_tokens, null.cut_before_usage, null.pad_bytes = 0, 1, False, 0
    null.cut_responses_stream, null.usage = False, (7, 3)


async def quota_used(proxy: ServedProxy) -> float:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"{proxy.admin_url}/admin/status", headers=headers, timeout=aiohttp.ClientTimeout(10)
        ) as resp,
    ):
        status = await resp.json()
    rows = {t["name"]: t for t in status["tenants"]}
    used: float = rows["tenant-normal"]["quota"]["tokens_per_day"]["used"]
    return used


async def one_billed(proxy: ServedProxy, log: Path, path: str, body: dict[str, Any]) -> Any:
    """Send ``body``; (the answer, its usage-log line), once the quota agrees with it."""
    request = json_request(path, {"model": "tiny", **body}, KEYS["normal"])
    answer = await exchange(proxy.host, proxy.port, request, timeout_s=30)
    await wait_for(lambda: len(usage_records(log)) == 1, 10, "the usage-log line")
    (record,) = usage_records(log)
    billed = record["prompt_tokens"] + record["completion_tokens"]
    assert await quota_used(proxy) == billed  # the quota counter and the usage log agree
    return answer, record


def served(start_served: StartServed, log: Path, **sections: Any) -> ServedProxy:
    return start_served(
        usage_log={"path": str(log)}, tiers={"normal": {"quota": QUOTA}}, **sections
    )


CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
COMPLETIONS = ("/v1/completions", {"prompt": "hi"})


@pytest.mark.parametrize(
    ("route", "n"), [(CHAT, 1), (COMPLETIONS, 2)], ids=["chat", "completions-n2"]
)
async def test_a_stream_cut_before_its_usage_is_billed_its_tokens_not_its_chunks(
    start_served: StartServed, fake: FakeVLLM, tmp_path: Path, route: Any, n: int
) -> None:
    # Before: completion_tokens 149 (one a chunk, less the opening) for 7,600 tokens.
    fake.stream_chunks, fake.chunk_tokens = CHUNKS // n, PER_CHUNK
    fake.cut_before_usage = True
    log = tmp_path / "usage.jsonl"
    proxy = served(start_served, log)
    path, body = route
    answer, record = await one_billed(
        proxy, log, path, {**body, "stream": True, "n": n, "max_tokens": 10_000}
    )
    assert answer.status == 200 and answer.body.count(b"tok ") == CHUNKS * PER_CHUNK
    assert record["outcome"] == "upstream_error"
    assert record["completion_tokens"] >= CHUNKS * PER_CHUNK
    assert (record["usage_estimated"], record["usage_basis"]) == (True, "delivered")


async def test_a_responses_stream_cut_before_its_last_event_is_billed_its_tokens(
    start_served: StartServed, fake: FakeVLLM, tmp_path: Path
) -> None:
    # Before: one token a delta event: 152 for 7,600. The backend broke the stream: billed
    # what it delivered (a cut by its client or the tier's limit: its reservation, since a
    # token without text has no event; tests/integration/test_token_drain_served.py).
    fake.stream_chunks, fake.chunk_tokens, fake.cut_responses_stream = CHUNKS, PER_CHUNK, True
    log = tmp_path / "usage.jsonl"
    proxy = served(start_served, log)
    body = {"input": "hi", "stream": True, "max_output_tokens": 10_000}
    answer, record = await one_billed(proxy, log, "/v1/responses", body)
    assert answer.status == 200 and answer.body.count(b"tok ") == CHUNKS * PER_CHUNK
    assert record["completion_tokens"] >= CHUNKS * PER_CHUNK
    assert record["usage_basis"] == "delivered"


async def test_an_answer_past_the_size_limit_is_billed_the_usage_inside_it(
    start_served: StartServed, fake: FakeVLLM, tmp_path: Path
) -> None:
    # Before: 502 and billed 0/0 in the usage log and the quota (300,100 tokens for 10).
    fake.pad_bytes, fake.usage = 3 * 1024 * 1024, ENGINE_USAGE
    log = tmp_path / "usage.jsonl"
    proxy = served(start_served, log, relay={"max_response_bytes": 1024 * 1024})
    body = {"prompt": "hi", "max_tokens": 30_000, "logprobs": 5}
    answer, record = await one_billed(proxy, log, "/v1/completions", body)
    assert answer.status == 502 and answer.error_code() == "upstream_too_large"
    assert (record["prompt_tokens"], record["completion_tokens"]) == ENGINE_USAGE
    assert (record["usage_estimated"], record["usage_basis"]) == (False, "backend")


async def test_an_answer_past_the_size_limit_without_usage_in_reach_is_billed_its_reservation(
    start_served: StartServed, fake: FakeVLLM, tmp_path: Path
) -> None:
    # Before: billed 0. Past the scan's bytes the usage is out of reach: its worst case.
    fake.pad_bytes, fake.usage = 3 * 1024 * 1024, ENGINE_USAGE
    log = tmp_path / "usage.jsonl"
    relay = {"max_response_bytes": 1024 * 1024, "oversize_scan_bytes": 0}
    proxy = served(start_served, log, relay=relay)
    body = {"prompt": "hi", "max_tokens": 30_000, "logprobs": 5}
    answer, record = await one_billed(proxy, log, "/v1/completions", body)
    assert answer.status == 502 and answer.error_code() == "upstream_too_large"
    assert record["completion_tokens"] == 30_000 and record["prompt_tokens"] >= 1
    assert (record["usage_estimated"], record["usage_basis"]) == (True, "reservation")
