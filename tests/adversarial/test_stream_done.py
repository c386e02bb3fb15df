"""A stream ends at its ``[DONE]`` event, through the real pipeline (tests/helpers/rig.py) against
the fake vLLM playing odd backends: what follows ``[DONE]`` (in the same write) is neither
forwarded nor billed; ``[DONE]`` as one data line of a multi-line event does not end the stream;
the terminal chunks the relay holds for the usage chunk's fingerprint go out before ``[DONE]``
(an SDK stops reading there) when no usage chunk comes, and before the error event of a stream
cut short. The served twin: tests/adversarial/served/test_stream_done_served.py."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import auth, make_config, running_proxy, until
from tests.helpers.clock import FakeClock
from tests.helpers.rig import BODY, relay_config, rig, stream_body
from tests.helpers.sse_answers import chunk, sse_answer

DONE = b"data: [DONE]\n\n"
COMPLETION = {"tier": "normal", "kind": "completion"}


def choice(index: int, finish: str | None = None) -> bytes:
    delta = {} if finish else {"content": "t"}
    body = {
        "object": "chat.completion.chunk",
        "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


def usage(completion: int) -> bytes:
    counts = {"prompt_tokens": 7, "completion_tokens": completion}
    return b"data: " + orjson.dumps({"choices": [], "usage": counts}) + b"\n\n"


def error_event() -> bytes:
    error = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
    return b"data: " + orjson.dumps(error) + b"\n\n"


async def test_what_follows_done_in_the_same_write_is_not_forwarded_nor_billed(
    clock: FakeClock,
) -> None:
    async def answer(request: web.Request, n: int) -> web.StreamResponse:
        head = chunk("a") + chunk("b") + choice(0, "stop") + usage(3)
        return await sse_answer(request, head, DONE + chunk("AFTER") + usage(100_000))

    async with FakeVLLM(script=answer).serve() as url, rig(relay_config(url), clock) as r:
        resp = await r.chat(stream=True)
        body = await resp.read()
        assert resp.status == 200 and body.endswith(DONE) and b"AFTER" not in body
        assert body.count(b"[DONE]") == 1
        assert r.metric("tierproxy_tokens_total", COMPLETION) == 3  # was 100,000
        assert r.requests_total("ok") == 1


async def test_done_as_one_data_line_of_an_event_does_not_end_the_stream() -> None:
    two_lines = chunk("x").rstrip(b"\n") + b"\ndata: [DONE]\n\n"  # its data: '{...}\n[DONE]'
    seen = asyncio.Event()  # the client has that event: the rest comes in a later read

    async def answer(request: web.Request, n: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk("a") + two_lines)
        await seen.wait()
        await resp.write(chunk("c") + chunk("d") + choice(0, "stop") + usage(4) + DONE)
        await resp.write_eof()
        return resp

    # On the real clock: the stream waits mid-way (the rig's fake clock is the deadline's).
    async with (
        FakeVLLM(script=answer).serve() as upstream,
        running_proxy(make_config([{"url": upstream}])) as (url, state),
        aiohttp.ClientSession() as session,
    ):
        body = {**BODY, "stream": True}
        path = url + "/v1/chat/completions"
        async with session.post(path, json=body, headers=auth("normal")) as resp:
            got = b""
            while not got.endswith(two_lines):
                async with asyncio.timeout(30):  # against hanging
                    line = await resp.content.readline()
                assert line, got
                got += line
            seen.set()
            async with asyncio.timeout(30):  # against hanging
                got += await resp.read()
        assert resp.status == 200 and b'"c"' in got and b'"d"' in got  # was cut at x
        assert got.endswith(b'"finish_reason":"stop"}]}\n\n' + DONE)
        registry = state.metrics.registry
        await until(
            lambda: registry.get_sample_value("tierproxy_tokens_total", COMPLETION) is not None,
            5,
            "the stream to be billed",
        )
        assert registry.get_sample_value("tierproxy_tokens_total", COMPLETION) == 4  # vLLM's


async def test_held_terminal_chunks_come_before_done_without_a_usage_chunk(
    clock: FakeClock,
) -> None:
    """vLLM's n=2 stream whose choice 1 fails after choice 0 finished: an error event, then
    [DONE], and no usage chunk. Choice 0's finish_reason came after [DONE]."""

    async def answer(request: web.Request, n: int) -> web.StreamResponse:
        parts = choice(0) + choice(1), choice(0, "stop"), choice(1), error_event(), DONE
        return await sse_answer(request, *parts)

    async with FakeVLLM(script=answer).serve() as url, rig(relay_config(url), clock) as r:
        resp = await r.chat(stream=True, n=2)
        events = await stream_body(resp)
        assert events[-1] == b"data: [DONE]"
        assert events[-2] == choice(0, "stop").strip()  # before [DONE], not after it
        assert events.count(b"data: [DONE]") == 1
        assert r.requests_total("backend_error") == 1


async def test_held_terminal_chunks_come_before_the_error_event_of_a_stream_cut_short(
    clock: FakeClock,
) -> None:
    async def answer(request: web.Request, n: int) -> web.StreamResponse:
        too_large = b"data: " + b"x" * 100_000 + b"\n\n"
        return await sse_answer(request, choice(0) + choice(1), choice(0, "stop"), too_large)

    config = relay_config(url="", max_event_bytes=64_000)
    async with FakeVLLM(script=answer).serve() as url:
        config["backends"] = [{"url": url}]
        async with rig(config, clock) as r:
            resp = await r.chat(stream=True, n=2)
            events = await stream_body(resp)
            assert events[2] == choice(0, "stop").strip()  # was lost
            assert b"upstream_too_large" in events[3] and events[4:] == [b"data: [DONE]"]
