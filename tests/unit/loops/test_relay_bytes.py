"""Nothing lost: an answer through the proxy is byte for byte the one the backend sends the
client directly, apart from the headers the proxy sets and the usage chunk it strips, however
the backend cuts its writes; on the standard loop and on uvloop. The fake renders streams as
vLLM 0.32 does (chat_completion/serving.py): ``system_fingerprint`` on the terminal chunk
without ``include_usage``, on the usage chunk with it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM, Script
from proxy.bench.inproc import auth
from proxy.relay.budget import MemoryBudget
from proxy.relay.forward import RelayResult, UpstreamCall
from proxy.relay.held import HeldResponse
from proxy.request.route_table import ROWS
from tests.helpers.clock import FakeClock
from tests.helpers.rig import BODY, relay_config, rig, served_rig

FINGERPRINT = "vllm-0.32.0-1a2b3c4d"
USAGE = {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}
CUTS = {
    "burst": [1 << 20],  # the whole answer in one write
    "events": [],  # one write per event
    "odd": [1, 7, 50, 3, 200, 13, 2],  # writes that cut events anywhere
}


def _chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "tiny"}
    return b"data: " + orjson.dumps({**head, "choices": choices, **extra}) + b"\n\n"


def vllm_stream(include_usage: bool, words: int = 5) -> list[bytes]:
    delta = {"index": 0, "logprobs": None, "finish_reason": None}
    events = [_chunk([{**delta, "delta": {"role": "assistant", "content": ""}}])]
    events += [_chunk([{**delta, "delta": {"content": f" w{i}"}}]) for i in range(words)]
    last = [{**delta, "delta": {"content": ""}, "finish_reason": "length", "stop_reason": None}]
    fingerprint = {} if include_usage else {"system_fingerprint": FINGERPRINT}
    events.append(_chunk(last, **fingerprint))
    if include_usage:
        events.append(_chunk([], usage=USAGE, system_fingerprint=FINGERPRINT))
    return [*events, b"data: [DONE]\n\n"]


def completion() -> bytes:
    message = {"role": "assistant", "content": "a b c", "refusal": None}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "tiny"}
    return orjson.dumps({**body, "choices": [choice], "usage": USAGE, "prompt_logprobs": None})


def writes(data: list[bytes], cuts: list[int]) -> list[bytes]:
    if not cuts:
        return data
    whole, out, at, i = b"".join(data), [], 0, 0
    while at < len(whole):
        out.append(whole[at : at + cuts[i % len(cuts)]])
        at += cuts[i % len(cuts)]
        i += 1
    return out


def vllm_like(cut: str) -> Script:
    """Answers as vLLM would the request it got, written in the cuts of ``cut``."""

    async def chat(request: web.Request, n: int) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        if not body.get("stream"):
            return web.Response(body=completion(), content_type="application/json")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        assert request.transport is not None
        request.transport.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
        )
        for part in writes(vllm_stream(include_usage), CUTS[cut]):
            await resp.write(part)
            await asyncio.sleep(0)  # a separate send, where the kernel keeps them apart
        await resp.write_eof()
        return resp

    return chat


async def direct(url: str, body: dict[str, Any]) -> bytes:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/chat/completions", json=body) as resp,
    ):
        return await resp.read()


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize(
    "ask",
    [{"stream": False}, {"stream": True}, {"stream": True, "usage": True}],
    ids=["json", "stream", "stream-usage"],
)
async def test_the_client_gets_the_direct_bytes(
    clock: FakeClock, cut: str, ask: dict[str, bool]
) -> None:
    body: dict[str, Any] = {**BODY, "stream": ask["stream"]}
    if ask.get("usage"):
        body["stream_options"] = {"include_usage": True}
    backend = FakeVLLM(script=vllm_like(cut))
    async with backend.serve() as url, rig(relay_config(url), clock) as r:
        expected = await direct(url, body)
        relay, held_after_relay = ROWS["chat"].relay, []

        async def spy(call: UpstreamCall, request: web.Request, **kw: Any) -> RelayResult:
            result = await relay(call, request, **kw)
            if isinstance(result.response, HeldResponse):
                held_after_relay.append(result.response.held.amount)
            return result

        r.state.pipeline.relay = spy
        resp = await r.client.post("/v1/chat/completions", json=body, headers=auth("normal"))
        got = await resp.read()
        assert resp.status == 200
        assert got == expected
        # The id the backend got, on the streamed answer's headers too (set before prepare).
        assert resp.headers["X-Request-Id"] == backend.received[-1].headers["X-Request-Id"] != ""
        if ask["stream"]:
            assert b"data: [DONE]" in got and (b'"usage"' in got) == bool(ask.get("usage"))
            assert got.count(FINGERPRINT.encode()) == 1
        assert r.metric("tierproxy_tokens_total", {"tier": "normal", "kind": "completion"}) == 5
        # A buffered answer's bytes count against the memory budget until sent, then not.
        assert held_after_relay == ([] if ask["stream"] else [len(expected)])
        assert r.state.budget.held == 0


async def test_a_buffered_answer_holds_its_bytes_until_sent() -> None:
    budget = MemoryBudget(None)
    held = budget.try_reserve(100)
    assert held is not None
    sent = HeldResponse(200, b"x" * 100, {}, held)
    assert budget.held == 100
    with contextlib.suppress(Exception):  # not prepared: write_eof fails, and still releases
        await sent.write_eof()
    assert budget.held == 0
    again = budget.try_reserve(50)
    assert again is not None
    dropped = HeldResponse(200, b"y" * 50, {}, again)
    assert budget.held == 50
    del dropped  # never sent (the client left): given back when it is dropped
    gc.collect()
    assert budget.held == 0


async def test_a_stream_that_stalls_past_the_deadline_ends_with_a_timeout_event(
    clock: FakeClock,
) -> None:
    """One timer for the whole stream: a read waiting at the deadline ends the stream."""
    first = vllm_stream(include_usage=True)[0]

    async def stalls(request: web.Request, n: int) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(first)
        await asyncio.sleep(30)  # cancelled when the proxy closes the connection
        return resp

    async with served_rig(
        clock, FakeVLLM(script=stalls), tiers={"normal": {"request_timeout_s": 0.4}}
    ) as r:
        resp = await r.chat(stream=True)
        got = await resp.read()
    assert got.startswith(first) and got.endswith(b"data: [DONE]\n\n")
    assert b'"code":"request_timeout"' in got
    assert r.metric("tierproxy_requests_total", {"tier": "normal", "outcome": "timeout"}) == 1
