"""What a client can get without paying, against the process that serves (`tierproxy serve` on
uvloop with aiohttp's C parser) and realistic clients from the kit (issue 22's fresh-eyes
findings 4-6): a stream cut after reading almost all of it, a stream the tier's time limit cuts,
a large answer whose usage vLLM writes before a client-sized tail, a prompt list far over the
tenant's tokens_per_minute. The in-process twins: tests/unit/request/test_cut_stream_billing.py,
tests/adversarial/test_relay_faults.py (usage first), tests/unit/request/test_tpm_bound.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import RawClient, exchange, json_request
from proxy.bench.hostile.served import NullBackend, StartServed
from proxy.bench.inproc import KEYS
from proxy.config.tenants import hash_key
from proxy.request.admitted import STEPS_PAST_CUT
from tests.helpers.served_logs import usage_records, wait_for

TOKEN = b'"content":"tok "'
TOKEN_BYTES = len("tok ")  # a cut stream is billed its text's bytes (no tokenizer loaded)
USAGE = {"prompt_tokens": 10, "completion_tokens": 1500, "total_tokens": 1510}


def _chunk(delta: bytes) -> bytes:
    return (
        b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"tiny",'
        b'"choices":[{"index":0,"delta":%s,"logprobs":null,"finish_reason":null}]}\n\n' % delta
    )


async def billing_answers(request: web.Request, n: int) -> web.StreamResponse:
    """vLLM-shaped answers chosen by the body's ``user``: "hang" streams ``max_tokens`` tokens
    then waits (the engine goes on until its caller leaves), "slow" streams a token every
    10 ms for ever, "hold" never answers (a non-stream request still decoding), "bigtail" answers with usage before a 1.7 MB ``prompt_logprobs``; a
    completions call runs to its ``max_tokens`` (none: the context's end)."""
    body = await request.json()
    if request.path == "/v1/completions":
        return _completion(body)
    if body.get("user") == "bigtail":
        return web.Response(body=_bigtail(), content_type="application/json")
    if body.get("user") == "hold":  # a non-stream answer: nothing until the engine is done
        await asyncio.Event().wait()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_chunk(b'{"role":"assistant","content":""}'))
    if body.get("user") == "slow":
        while True:  # until the proxy's deadline closes the connection
            await resp.write(_chunk(b'{"content":"tok "}'))
            await asyncio.sleep(0.01)
    await resp.write(_chunk(b'{"content":"tok "}') * int(body["max_tokens"]))
    await asyncio.Event().wait()  # generating on, until the proxy hangs up
    return resp


def _completion(body: dict[str, Any]) -> web.Response:
    prompts = len(body["prompt"]) if isinstance(body["prompt"], list) else 1
    completion = int(body.get("max_tokens") or 30_000) * prompts  # none: the context's end
    usage = {"prompt_tokens": prompts, "completion_tokens": completion}
    choices = [{"index": i, "text": "x", "finish_reason": "length"} for i in range(prompts)]
    return web.json_response({"object": "text_completion", "choices": choices, "usage": usage})


def _bigtail() -> bytes:
    """vLLM's ChatCompletionResponse field order: ..., usage, prompt_logprobs, prompt_token_ids."""
    message = {"role": "assistant", "content": "tok " * 1000}
    logprobs = [None] + [
        {str(1000 + i): {"logprob": -1.25, "rank": 1, "decoded_token": "abc"}}
        for i in range(30_000)
    ]
    answer = {
        "id": "c",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
        "usage": USAGE,
        "prompt_logprobs": logprobs,
        "prompt_token_ids": None,
    }
    return orjson.dumps(answer)


class Upstream(NullBackend):
    def __init__(self) -> None:
        super().__init__(FakeVLLM(script=billing_answers))

    def generations(self) -> int:
        return len(self.null.received)


@pytest.fixture(scope="module")
def backend() -> Iterator[Upstream]:
    """This module's fake backend (the served fixtures forward to it)."""
    with Upstream() as upstream:
        yield upstream


def chat(user: str, **extra: object) -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "user": user}
    return json_request("/v1/chat/completions", {**body, **extra}, KEYS["normal"])


async def test_a_client_that_leaves_just_before_the_usage_is_billed_what_it_read(
    start_served: StartServed, tmp_path: Path
) -> None:
    # Before: billed completion_tokens=0 (the handler was cancelled; nothing was accounted).
    log = tmp_path / "usage.jsonl"
    proxy = start_served(usage_log={"path": str(log)})
    client = await RawClient.connect(proxy.host, proxy.port)
    try:
        await client.send(chat("hang", stream=True, max_tokens=3000))
        read = await client.read_until(TOKEN, 2995, timeout_s=20)
    finally:
        client.abort()  # gone, with 2,995 of 3,000 tokens in hand
    assert read >= 2995
    await wait_for(lambda: len(usage_records(log)) == 1, 10, "the usage-log line")
    (record,) = usage_records(log)
    assert (record["status"], record["outcome"]) == (499, "client_gone")
    assert read <= record["completion_tokens"] <= 3000 * TOKEN_BYTES
    assert record["usage_estimated"] is True and record["prompt_tokens"] > 0


async def test_a_non_stream_request_cut_while_the_engine_runs_it_is_billed(
    start_served: StartServed, backend: Upstream, tmp_path: Path
) -> None:
    # Before: 499 billed prompt 0, completion 0 (fresh eyes q03): closing just before the
    # answer got the engine's work for nothing, past the tenant's quota.
    log = tmp_path / "usage.jsonl"
    proxy = start_served(usage_log={"path": str(log)})
    before = backend.generations()
    client = await RawClient.connect(proxy.host, proxy.port)
    try:
        await client.send(chat("hold", max_tokens=700))
        await wait_for(lambda: backend.generations() == before + 1, 10, "the backend's call")
    finally:
        client.abort()
    await wait_for(lambda: len(usage_records(log)) == 1, 10, "the usage-log line")
    (record,) = usage_records(log)
    assert (record["status"], record["outcome"]) == (499, "client_gone")
    assert record["prompt_tokens"] > 0 and record["completion_tokens"] == 700
    assert record["usage_estimated"] is True


async def test_a_stream_cut_by_the_request_timeout_is_billed_what_it_delivered(
    start_served: StartServed, tmp_path: Path
) -> None:
    # Before: outcome=timeout completion_tokens=0, and the fairness charge refunded to zero.
    log = tmp_path / "usage.jsonl"
    proxy = start_served(usage_log={"path": str(log)}, tiers={"normal": {"request_timeout_s": 2}})
    answer = await exchange(proxy.host, proxy.port, chat("slow", stream=True), timeout_s=15)
    seen = answer.body.count(TOKEN)
    assert answer.status == 200 and b"request_timeout" in answer.body and seen > 20
    await wait_for(lambda: len(usage_records(log)) == 1, 10, "the usage-log line")
    (record,) = usage_records(log)
    assert record["outcome"] == "timeout"
    billed = record["completion_tokens"]
    assert 0.9 * seen * TOKEN_BYTES <= billed <= seen * TOKEN_BYTES + STEPS_PAST_CUT
    assert record["usage_estimated"] is True


async def test_a_large_answer_with_its_usage_before_the_tail_is_billed(
    start_served: StartServed, tmp_path: Path
) -> None:
    # Before: usage log prompt=0 completion=0 (only the last 64 KiB were searched).
    log = tmp_path / "usage.jsonl"
    proxy = start_served(usage_log={"path": str(log)})
    answer = await exchange(proxy.host, proxy.port, chat("bigtail"), timeout_s=20)
    assert answer.status == 200 and len(answer.body) > 1_500_000
    await wait_for(lambda: len(usage_records(log)) == 1, 10, "the usage-log line")
    (record,) = usage_records(log)
    assert (record["prompt_tokens"], record["completion_tokens"]) == (10, 1500)
    assert record["usage_estimated"] is False


async def test_a_prompt_list_over_the_whole_tpm_bucket_is_refused_for_good(
    start_served: StartServed, backend: Upstream
) -> None:
    # Before: 200 OK, 409,610 tokens against tokens_per_minute 6,000 (the bucket was full);
    # and a prompt list without max_tokens went on without one.
    tenant = {"name": "tenant-normal", "tier": "normal", "tokens_per_minute": 6000}
    tenants = [{**tenant, "keys": [{"sha256": hash_key(KEYS["normal"])}]}]
    proxy = start_served(tenants=tenants)
    before = backend.generations()
    body = {"model": "tiny", "prompt": ["p"] * 200, "max_tokens": 2048}
    request = json_request("/v1/completions", body, KEYS["normal"])
    answer = await exchange(proxy.host, proxy.port, request)
    assert answer.status == 429 and answer.error_code() == "request_over_token_limit"
    assert answer.headers["x-should-retry"] == "false" and "retry-after" not in answer.headers
    assert backend.generations() == before
    fits = {"model": "tiny", "prompt": ["p"] * 2, "max_tokens": 500}
    ok = await exchange(
        proxy.host, proxy.port, json_request("/v1/completions", fits, KEYS["normal"])
    )
    assert ok.status == 200 and backend.generations() == before + 1
    # No max_tokens: vLLM runs each of 10 prompts to its default, 16 tokens, under their
    # share of the minute's limit: sent on as it came (the share went on once, and ran).
    unset = {"model": "tiny", "prompt": ["p"] * 10}
    request = json_request("/v1/completions", unset, KEYS["normal"])
    answer = await exchange(proxy.host, proxy.port, request)
    assert answer.status == 200 and "max_tokens" not in backend.null.received[-1].body
