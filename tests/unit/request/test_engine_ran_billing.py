"""Bill what the engine ran (issue 30, "Why" bullets 3 and 4), in process on the fake clock:
every meter (day quota, tokens_per_minute, fairness, token metrics, usage log) bills the same
for a stream cut before its usage chunk (its tokens, not its chunks) and for an answer past
``relay.max_response_bytes`` (the usage inside it, else its reservation). The served twin:
tests/adversarial/served/test_billing_engine_ran.py."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.api.routes import BY_ENDPOINT
from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import SECRET, auth, make_config, until
from proxy.bench.vllm_answers import generation, usage_of
from proxy.config.loader import parse_config
from proxy.policies.cost import weighted_tokens
from proxy.policies.tenants import VirtualTokenCounter
from proxy.relay.delivered import Delivered
from proxy.request.admitted import STEPS_PAST_CUT, past_the_cut
from proxy.server.state import ProxyState
from tests.helpers.clock import FakeClock
from tests.helpers.rig import tenants

TENANT = "tenant-normal"
TPM, DAY = 10_000_000, 10_000_000
BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 30_000}


@contextlib.asynccontextmanager
async def rig(
    backend: FakeVLLM, clock: FakeClock, records: list[dict[str, Any]], **relay: int
) -> AsyncIterator[tuple[ProxyState, TestClient[web.Request, web.Application]]]:
    limits = {"tokens_per_minute": TPM, "quota": {"tokens_per_day": DAY}}
    async with backend.serve() as url:
        config = make_config([{"url": url}], tenants=tenants(**limits), relay=relay)
        state = ProxyState(parse_config(yaml.safe_dump(config), "test"), SECRET, clock)
        state.usage.sink = lambda line: records.append(orjson.loads(line))
        async with aiohttp.ClientSession() as session:
            state.session = session
            app = web.Application()
            handler = state.pipeline.handler(BY_ENDPOINT["completions"])
            app.router.add_post("/v1/completions", handler)
            state.dispatcher.start()
            try:
                async with TestClient(TestServer(app)) as client:
                    yield state, client
            finally:
                await state.dispatcher.stop()


def meters(state: ProxyState, clock: FakeClock) -> dict[str, float]:
    quota = state.quota_book.usage(TENANT, {"tokens_per_day": DAY}, time.time())
    window = state.limits.windows(TENANT, clock())["tokens"]
    fairness = state.queue.fairness
    assert isinstance(fairness, VirtualTokenCounter)

    def tokens(kind: str) -> float:
        labels = {"tier": "normal", "kind": kind}
        sample = state.metrics.registry.get_sample_value("tierproxy_tokens_total", labels)
        return sample or 0.0

    return {
        "quota": quota["tokens_per_day"]["used"],
        "tpm": window.limit - window.remaining,
        "fairness": fairness.counter(TENANT),
        "prompt": tokens("prompt"),
        "completion": tokens("completion"),
    }


async def billed(backend: FakeVLLM, clock: FakeClock, body: dict[str, Any], **relay: int) -> Any:
    """(status, the usage-log line, every meter) of one request, its meters checked equal."""
    records: list[dict[str, Any]] = []
    async with rig(backend, clock, records, **relay) as (state, client):
        async with client.post("/v1/completions", json=body, headers=auth("normal")) as resp:
            status = resp.status
            with contextlib.suppress(aiohttp.ClientPayloadError):  # a relay cut mid-answer
                await resp.read()
        await until(lambda: bool(records), 5, "the usage record")
        m = meters(state, clock)
    (record,) = records
    prompt, completion = record["prompt_tokens"], record["completion_tokens"]
    assert m["quota"] == m["tpm"] == prompt + completion
    assert (m["prompt"], m["completion"]) == (prompt, completion)
    assert m["fairness"] == pytest.approx(weighted_tokens(prompt, completion))
    return status, record


@pytest.mark.parametrize("n", [1, 3])
async def test_a_cut_stream_is_billed_its_tokens_on_every_meter(clock: FakeClock, n: int) -> None:
    # Before: one token a chunk: 48 for 2,400 tokens.
    backend = FakeVLLM(stream_chunks=16, chunk_tokens=50, cut_before_usage=True)
    status, record = await billed(backend, clock, {**BODY, "stream": True, "n": n})
    assert status == 200
    assert record["completion_tokens"] >= 16 * 50 * n
    assert record["usage_basis"] == "delivered" and record["usage_estimated"] is True


async def test_an_oversize_answer_is_billed_its_usage_on_every_meter(clock: FakeClock) -> None:
    # Before: 0 on every meter.
    backend = FakeVLLM(pad_bytes=300_000, usage=(100, 30_000))
    status, record = await billed(backend, clock, BODY, max_response_bytes=100_000)
    assert status == 502
    assert (record["prompt_tokens"], record["completion_tokens"]) == (100, 30_000)
    assert record["usage_basis"] == "backend"


async def test_an_oversize_answer_streamed_through_is_billed_its_usage(clock: FakeClock) -> None:
    # No Content-Length to refuse it by: cut while relayed, its usage read from the rest.
    async def chunked(request: web.Request, n: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(generation("/x", "tiny", usage_of(100, 30_000), pad_bytes=300_000))
        await resp.write_eof()
        return resp

    backend = FakeVLLM(script=chunked)
    relay = {"max_response_bytes": 100_000, "buffer_response_bytes": 50_000}
    status, record = await billed(backend, clock, BODY, **relay)
    assert status == 200  # its start was relayed: the client's connection is cut
    assert (record["prompt_tokens"], record["completion_tokens"]) == (100, 30_000)


async def test_an_oversize_answer_past_the_scan_is_billed_its_reservation(
    clock: FakeClock,
) -> None:
    backend = FakeVLLM(pad_bytes=300_000, usage=(100, 30_000))
    relay = {"max_response_bytes": 100_000, "oversize_scan_bytes": 50_000}
    status, record = await billed(backend, clock, BODY, **relay)
    assert status == 502 and record["completion_tokens"] == BODY["max_tokens"]
    assert record["prompt_tokens"] >= 1 and record["usage_basis"] == "reservation"


# -- the counter of what a stream delivered ------------------------------------------------


def _chunk(choices: bytes) -> bytes:
    return b'data: {"id":"c","object":"chat.completion.chunk","choices":[%s]}\n\n' % choices


def test_the_text_bytes_bound_the_tokens_of_every_choice_and_field() -> None:
    delivered = Delivered()
    delivered.chunks(
        _chunk(b'{"index":0,"delta":{"role":"assistant","content":""}}')
        + _chunk(b'{"index":0,"delta":{"content":"ab \\"q\\" \\u00e9"}}')  # escapes >= bytes
        + _chunk(b'{"index":1,"delta":{"reasoning_content":"xyz"}}')
        + _chunk(b'{"index":0,"delta":{"tool_calls":[{"function":{"arguments":"{}"}}]}}')
        + _chunk(b'{"index":1,"text":"12345","logprobs":{"tokens":["1"]}}')
    )
    text = 'ab "q" \u00e9'.encode() + b"xyz" + b"{}" + b"12345"
    assert delivered.events == 4
    assert delivered.text_bytes >= len(text)
    assert delivered.output_bound == delivered.text_bytes


def test_a_chunk_without_text_still_counts_one_token() -> None:
    delivered = Delivered()
    delivered.chunks(_chunk(b'{"index":0,"delta":{"content":""}}') * 3)
    assert delivered.output_bound == 3


def test_responses_count_the_deltas_text_not_the_done_events_repeat() -> None:
    delivered = Delivered()
    delivered.responses_event(
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"delta":"hello"}\n\n'
    )
    delivered.responses_event(
        b'event: response.output_text.done\ndata: {"type":"response.output_text.done",'
        b'"text":"hello"}\n\n'
    )
    assert (delivered.events, delivered.text_bytes) == (1, 5)


def test_a_cut_stream_is_billed_the_engines_steps_past_the_cut_within_its_budget() -> None:
    """Red team, 2026-12-06: vLLM ran a step on after the proxy stopped reading (487 tokens
    generated, 485 delivered for n=1; 1,737 and 1,729 for n=8): each sequence is billed
    ``STEPS_PAST_CUT`` tokens more, never past its budget nor under what it delivered."""
    assert past_the_cut(485, 1, 1_000) == 485 + STEPS_PAST_CUT >= 487
    assert past_the_cut(1_729, 8, 8_000) == 1_729 + 8 * STEPS_PAST_CUT >= 1_737
    assert past_the_cut(999, 1, 1_000) == 1_000  # the budget: no more could be made
    assert past_the_cut(1_200, 1, 1_000) == 1_200  # bytes bound past the budget: kept
    assert past_the_cut(0, 4, 1_000) == 0  # nothing delivered: nothing ran that is known of
