"""The SSE reader: complete events whatever the line arrival, data fields, a cut stream."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.relay import sse


async def _lines(*lines: bytes) -> AsyncIterator[bytes]:
    for line in lines:
        yield line


async def _events(*lines: bytes) -> list[bytes]:
    return [e async for e in sse.read_events(_lines(*lines))]


async def test_events_end_at_the_blank_line() -> None:
    assert await _events(b"data: 1\n", b"\n", b"event: x\n", b"data: 2\n", b"\r\n") == [
        b"data: 1\n\n",
        b"event: x\ndata: 2\n\r\n",
    ]


async def test_a_cut_event_is_completed_and_trailing_blanks_are_not_events() -> None:
    assert await _events(b"data: 1\n", b"\n", b'data: {"x"') == [
        b"data: 1\n\n",
        b'data: {"x"\n',
    ]
    assert await _events(b"data: 1\n", b"\n", b"\n") == [b"data: 1\n\n", b"\n"]
    assert await _events() == []


@pytest.mark.parametrize(
    ("event", "data"),
    [
        (b'data: {"a": 1}\n\n', b'{"a": 1}'),
        (b"data:[DONE]\n\n", sse.DONE),
        (b"event: e\ndata: one\ndata:  two\n\n", b"one\n two"),  # one leading space is dropped
        (b": keep-alive\n\n", None),
    ],
)
def test_event_data(event: bytes, data: bytes | None) -> None:
    assert sse.event_data(event) == data


def _chunks() -> Iterator[bytes]:
    # Split inside lines and across events, as a network would.
    yield b'data: {"n": 1}\n\nda'
    yield b'ta: {"n": 2}\n'
    yield b"\n: ping\n\ndata: [DONE]\n\n"


async def test_data_of_a_real_streaming_response() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in _chunks():
            await resp.write(chunk)
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/")
        assert [d async for d in sse.data_of(resp)] == [b'{"n": 1}', b'{"n": 2}', sse.DONE]
