"""Faulty backends and clients that stop reading, through the real pipeline (the rig of
tests/helpers/rig.py) against the fake vLLM playing faults scripted here: each fault is an OpenAI-shaped
502 before the first byte (retried only where the backend cannot have run the request, once
after a reset), an error event and [DONE] after it, and a stalled client frees its slot."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM, Script
from proxy.bench.inproc import auth, make_config, until
from proxy.relay import sse
from tests.helpers.clock import FakeClock
from tests.helpers.rig import BODY, Rig, error_of, relay_config, rig, stream_body
from tests.helpers.sse_answers import chunk, sse_answer

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
ENGINE_DEAD = {
    "error": {
        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


def completion(content: str) -> bytes:
    message = {"role": "assistant", "content": content}
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    return orjson.dumps({"object": "chat.completion", "choices": [choice], "usage": USAGE})


async def reset(request: web.Request, n: int) -> web.StreamResponse:
    assert request.transport is not None
    request.transport.abort()  # it read the request, then the connection drops
    return web.Response()


# -- before the first byte: 502, retried only where it cannot have run ------------------------


@contextlib.asynccontextmanager
async def invalid_http_backend(counter: list[int]) -> AsyncIterator[str]:
    """Reads the request, answers bytes that are not HTTP."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if b"content-length" in line.lower()
        )
        await reader.readexactly(length)
        counter.append(1)
        writer.write(b"this is not HTTP\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def test_invalid_http_is_a_502_after_one_retry(clock: FakeClock) -> None:
    received: list[int] = []
    async with invalid_http_backend(received) as url, rig(relay_config(url), clock) as r:
        resp = await r.chat()
        assert resp.status == 502 and (await error_of(resp))["code"] == "upstream_reset"
        assert len(received) == 2  # it may have run: one retry, never max_attempts (3)
        assert r.backend().failures == 2 and r.backend().inflight == 0
        assert r.requests_total("upstream_error") == 1


@pytest.mark.parametrize("retries", [0, 1])
async def test_a_backend_reset_after_reading_is_retried_at_most_as_configured(
    clock: FakeClock, retries: int
) -> None:
    backend = FakeVLLM(script=reset)
    async with (
        backend.serve() as url,
        rig(relay_config(url, max_reset_retries=retries), clock) as r,
    ):
        resp = await r.chat()
        assert resp.status == 502 and (await error_of(resp))["code"] == "upstream_reset"
        assert len(backend.received) == 1 + retries
        assert r.metric("tierproxy_retries_total") == retries


async def test_a_reset_then_an_answer_is_served(clock: FakeClock) -> None:
    async def answer(request: web.Request, n: int) -> web.StreamResponse:
        if n == 1:
            return await reset(request, n)
        return web.Response(body=completion("ok"), content_type="application/json")

    backend = FakeVLLM(script=answer)
    async with backend.serve() as url, rig(relay_config(url), clock) as r:
        resp = await r.chat()
        assert resp.status == 200 and len(backend.received) == 2


async def test_a_request_alone_on_an_engine_that_dies_is_not_retried(clock: FakeClock) -> None:
    # Finding #11: the likely poison pill; retried, it killed the next engines one by one.
    async def answer(request: web.Request, n: int) -> web.StreamResponse:
        if n == 1:
            return web.json_response(ENGINE_DEAD, status=500)
        return web.Response(body=completion("ok"), content_type="application/json")

    backend = FakeVLLM(script=answer)
    async with backend.serve() as url, rig(relay_config(url), clock) as r:
        resp = await r.chat()
        assert resp.status == 502 and (await error_of(resp))["code"] == "engine_dead"
        assert len(backend.received) == 1 and r.metric("tierproxy_retries_total") == 0
        labels = {"backend": url, "kind": "engine_dead"}
        assert r.metric("tierproxy_backend_errors_total", labels) == 1
        assert r.requests_total("upstream_error") == 1


async def test_requests_beside_others_on_an_engine_that_dies_fall_under_the_reset_bound(
    clock: FakeClock,
) -> None:
    # Two requests ran when the engine died: either may be the poison, so each counts as one
    # that may have run there (relay.max_reset_retries, here 0), never up to max_attempts.
    both_in = asyncio.Event()

    async def answer(request: web.Request, n: int) -> web.StreamResponse:
        if n == 2:
            both_in.set()
        await both_in.wait()
        return web.json_response(ENGINE_DEAD, status=500)

    backend = FakeVLLM(script=answer)
    async with backend.serve() as url, rig(relay_config(url, max_reset_retries=0), clock) as r:
        first, second = asyncio.create_task(r.chat()), asyncio.create_task(r.chat())
        for resp in await asyncio.gather(first, second):
            assert resp.status == 502 and (await error_of(resp))["code"] == "upstream_reset"
        assert len(backend.received) == 2 and r.metric("tierproxy_retries_total") == 0


async def test_engine_dead_on_every_attempt_ends_in_502(clock: FakeClock) -> None:
    async def answer(request: web.Request, n: int) -> web.StreamResponse:
        return web.json_response(ENGINE_DEAD, status=500)

    backend = FakeVLLM(script=answer)
    config = make_config([{"url": "x"}], backend_health={"max_attempts": 2})
    async with backend.serve() as url:
        config["backends"] = [{"url": url}]
        async with rig(config, clock) as r:
            first = await r.chat()  # alone on the engine when it died: not retried
            assert first.status == 502 and (await error_of(first))["code"] == "engine_dead"
            clock.advance(0.1)
            # Sent to an engine already failing: not its doing, so retried like a refusal.
            task = asyncio.create_task(r.chat())
            await until(lambda: r.backend().failures == 2, 5, "the second failure")
            await r.advance(5.0)  # its failure ejected the backend (2 in a row): that ends
            await until(lambda: len(backend.received) == 3 or task.done(), 5, "the retry")
            resp = await task
            assert resp.status == 502 and (await error_of(resp))["code"] == "backends_failed"


async def test_another_500_is_passed_through_and_a_non_json_5xx_becomes_502(
    clock: FakeClock,
) -> None:
    async def answer(request: web.Request, n: int) -> web.StreamResponse:
        if n == 1:
            error = {"error": {"message": "boom", "type": "x", "param": None, "code": None}}
            return web.json_response(error, status=500)
        return web.Response(text="Internal Server Error", status=500)

    backend = FakeVLLM(script=answer)
    async with backend.serve() as url, rig(relay_config(url), clock) as r:
        first = await r.chat()
        assert first.status == 500 and (await error_of(first))["message"] == "boom"
        second = await r.chat()
        assert second.status == 502 and (await error_of(second))["code"] == "upstream_error"
        assert len(backend.received) == 2  # neither retried: the backend ran them
        assert r.backend().failures == 2


@pytest.mark.parametrize("shape", ["one long line", "lines without a blank one"])
async def test_an_oversize_first_event_is_a_502_not_retried(clock: FakeClock, shape: str) -> None:
    async def answer(request: web.Request, n: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        with contextlib.suppress(ConnectionResetError):
            for _ in range(10_000):  # 10 MB if the proxy kept reading
                await resp.write(b"x" * 1000 if shape == "one long line" else b"data: x\n")
        return resp

    backend = FakeVLLM(script=answer)
    async with backend.serve() as url, rig(relay_config(url, max_event_bytes=64_000), clock) as r:
        # The request chose the size: its own 502 each time, never the backend's failure (two
        # in a row ejected it: any tenant could take healthy backends out).
        for sent in (1, 2, 3):
            resp = await r.chat(stream=True)
            assert resp.status == 502 and (await error_of(resp))["code"] == "upstream_too_large"
            assert len(backend.received) == sent and r.backend().failures == 0
        assert r.backend().available(r.clock())


# -- after the first byte: an error event and [DONE] ------------------------------------------


async def test_an_oversize_event_mid_stream_ends_with_an_error_event(clock: FakeClock) -> None:
    async def answer(request: web.Request, n: int) -> web.StreamResponse:
        return await sse_answer(request, chunk("a"), b"data: " + b"x" * 100_000 + b"\n\n")

    backend = FakeVLLM(script=answer)
    async with backend.serve() as url, rig(relay_config(url, max_event_bytes=64_000), clock) as r:
        resp = await r.chat(stream=True)
        assert resp.status == 200
        events = await stream_body(resp)
        assert events[0] == chunk("a").strip() and events[-1] == b"data: [DONE]"
        error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
        assert error["code"] == "upstream_too_large"
        assert r.backend().failures == 0  # the request's size, not the backend's fault
        assert r.requests_total("upstream_error") == 1


# -- non-stream answers: held up to a bound, streamed through past it, refused past the max ----


async def test_a_large_answer_is_streamed_through_with_its_usage(clock: FakeClock) -> None:
    body = completion("y" * 300_000)

    async def answer(request: web.Request, n: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)  # chunked: the proxy cannot know the size up front
        for at in range(0, len(body), 10_000):
            await resp.write(body[at : at + 10_000])
        await resp.write_eof()
        return resp

    backend = FakeVLLM(script=answer)
    bounds = {"buffer_response_bytes": 50_000, "max_response_bytes": 1_000_000}
    async with backend.serve() as url, rig(relay_config(url, **bounds), clock) as r:
        resp = await r.client.post("/v1/chat/completions", json=BODY, headers=auth("normal"))
        assert resp.status == 200 and await resp.read() == body
        assert r.metric("tierproxy_tokens_total", {"tier": "normal", "kind": "completion"}) == 3


def usage_first(content: str, prompt_logprobs: int) -> bytes:
    """vLLM's ChatCompletionResponse field order: ``usage`` before ``prompt_logprobs`` and
    ``prompt_token_ids`` (vllm/entrypoints/openai/chat_completion/protocol.py)."""
    message = {"role": "assistant", "content": content}
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    logprobs = [None] + [
        {str(1000 + i): {"logprob": -1.25, "rank": 1, "decoded_token": "usage"}}
        for i in range(prompt_logprobs)
    ]
    answer = {"object": "chat.completion", "choices": [choice], "usage": USAGE}
    return orjson.dumps({**answer, "prompt_logprobs": logprobs, "prompt_token_ids": None})


@pytest.mark.parametrize("piece", [10_000, 4_099, 7])
async def test_a_large_answer_whose_usage_comes_first_is_billed(
    clock: FakeClock, piece: int
) -> None:
    # Before: only the last 64 KiB were searched, and the usage is ~200 KB before the end:
    # no tokens counted, the fairness and tpm charges never corrected. ``piece`` cuts the
    # usage object across reads at many places (7 bytes: every one of its keys is cut).
    body = usage_first("y" * 1_000, 3_000)
    assert len(body) - body.find(b'"usage"') > 64 * 1024

    async def answer(request: web.Request, n: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        head = body.find(b'"usage"') - 3
        await resp.write(body[:head])  # past the held part, then small pieces
        for at in range(head, len(body), piece):
            await resp.write(body[at : at + piece])
        await resp.write_eof()
        return resp

    backend = FakeVLLM(script=answer)
    bounds = {"buffer_response_bytes": 1_000, "max_response_bytes": 1_000_000}
    async with backend.serve() as url, rig(relay_config(url, **bounds), clock) as r:
        resp = await r.client.post("/v1/chat/completions", json=BODY, headers=auth("normal"))
        assert resp.status == 200 and await resp.read() == body
        for kind, count in (("prompt", USAGE["prompt_tokens"]), ("completion", 3)):
            labels = {"tier": "normal", "kind": kind}
            assert r.metric("tierproxy_tokens_total", labels) == count


@pytest.mark.parametrize("announced", [True, False])
async def test_an_answer_over_the_max_is_refused_or_cut(clock: FakeClock, announced: bool) -> None:
    body = completion("y" * 300_000)

    async def answer(request: web.Request, n: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        if announced:
            resp.content_length = len(body)
        await resp.prepare(request)
        with contextlib.suppress(ConnectionResetError):
            for at in range(0, len(body), 10_000):
                await resp.write(body[at : at + 10_000])
            await resp.write_eof()
        return resp

    backend = FakeVLLM(script=answer)
    bounds = {"buffer_response_bytes": 50_000, "max_response_bytes": 100_000}
    async with backend.serve() as url, rig(relay_config(url, **bounds), clock) as r:
        resp = await r.client.post("/v1/chat/completions", json=BODY, headers=auth("normal"))
        if announced:
            assert resp.status == 502 and (await error_of(resp))["code"] == "upstream_too_large"
        else:
            assert resp.status == 200  # its start was sent: only a cut can say it failed
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        assert len(backend.received) == 1 and r.backend().failures == 0  # not the backend's
        await until(lambda: r.requests_total("upstream_error") == 1, 5, "the outcome")


# -- clients that stop reading -----------------------------------------------------------------


async def endless_stream(request: web.Request, n: int) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    event = chunk("z" * 16_000)
    while True:  # until the proxy closes the connection
        await resp.write(event)


async def endless_json(request: web.Request, n: int) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    await resp.write(b'{"choices":[{"message":{"content":"')
    while True:
        await resp.write(b"z" * 16_000)


@contextlib.asynccontextmanager
async def non_reading_client(r: Rig, body: dict[str, Any]) -> AsyncIterator[socket.socket]:
    """Sends the request with a small receive buffer, then never reads."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    payload = orjson.dumps(body)
    head = "".join(f"{k}: {v}\r\n" for k, v in auth("normal").items())
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n{head}"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    try:
        await loop.sock_connect(sock, (str(r.client.host), r.client.port))
        await loop.sock_sendall(sock, request)
        yield sock
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("answer", "stream"), [(endless_stream, True), (endless_json, False)], ids=["sse", "json"]
)
async def test_a_client_that_stops_reading_frees_its_slot_at_the_send_idle_timeout(
    clock: FakeClock, answer: Script, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "tierproxy.access")
    backend = FakeVLLM(script=answer)
    bounds = {"send_idle_timeout_s": 0.5, "buffer_response_bytes": 50_000}
    async with backend.serve() as url, rig(relay_config(url, **bounds), clock) as r:
        async with non_reading_client(r, {**BODY, "stream": stream}):
            await until(lambda: len(backend.received) == 1, 60, "the request at the backend")
            # The request deadline is 120 s: only the send-idle timeout (0.5 s) can free the
            # slot within these bounds (wide: a busy machine's seconds between two steps).
            await until(lambda: r.backend().inflight == 0, 60, "the slot to be freed")
            await until(lambda: backend.hung_up == 1, 60, "the upstream to be closed")
            await until(lambda: r.requests_total("client_stalled") == 1, 60, "the outcome")
        assert r.backend().failures == 0  # not the backend's fault
        assert "status=499 outcome=client_stalled" in caplog.text


async def test_a_stalled_client_is_cut_at_the_request_deadline(clock: FakeClock) -> None:
    backend = FakeVLLM(script=endless_stream)
    config = make_config(
        [{"url": "x"}],
        tiers={"normal": {"request_timeout_s": 1}},
        relay={"send_idle_timeout_s": 60},
    )
    async with backend.serve() as url:
        config["backends"] = [{"url": url}]
        async with rig(config, clock) as r, non_reading_client(r, {**BODY, "stream": True}):
            # The request deadline (1 s), not the send-idle timeout (60 s), frees it.
            await until(lambda: r.backend().inflight == 0, 30, "the slot to be freed")
            await until(lambda: r.requests_total("client_stalled") == 1, 30, "the outcome")


# -- the bounded SSE reader ----------------------------------------------------------------------


async def test_the_bounded_reader_cuts_events_as_the_line_reader_does() -> None:
    stream = b"data: a\n\n: keep-alive\r\n\r\n\ndata: b\ndata: c\n\ndata: [DONE]\n\ndata: cut"

    async def lines() -> AsyncIterator[bytes]:
        for line in stream.splitlines(keepends=True):
            yield line

    async def chunks(size: int) -> AsyncIterator[bytes]:
        for at in range(0, len(stream), size):
            yield stream[at : at + size]

    expected = [e async for e in sse.read_events(lines())]
    for size in range(1, len(stream) + 1):
        got = [e async for e in sse.read_events_bounded(chunks(size), 64)]
        assert got == expected, size
    with pytest.raises(sse.EventTooLarge):
        _ = [e async for e in sse.read_events_bounded(chunks(7), 12)]
