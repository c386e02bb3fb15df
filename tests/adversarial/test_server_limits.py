"""Client connections (proxy.server.listeners): the cap, the header timeout, keep-alive, open files; real
listeners on loopback, raw sockets as the clients."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from proxy.config.server import Server
from proxy.server.listeners import Listeners, raise_open_files_limit
from tests.proxyrun import until

GET = b"GET /ping HTTP/1.1\r\nHost: proxy\r\n\r\n"
Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def _app(handler_delay_s: float = 0.0) -> web.Application:
    async def ping(request: web.Request) -> web.Response:
        if handler_delay_s:
            await asyncio.sleep(handler_delay_s)  # the app being slow, not the test waiting
        return web.json_response({"pong": True})

    app = web.Application()
    app.router.add_get("/ping", ping)
    return app


@contextlib.asynccontextmanager
async def serving(
    settings: Server, app: web.Application, on_refused: Callable[[], None] | None = None
) -> AsyncIterator[tuple[Listeners, int]]:
    async with Listeners(settings, on_refused) as listeners:
        port = await listeners.add(app, "127.0.0.1", 0)
        yield listeners, port


async def response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP response with a Content-Length: (head, body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return head, await asyncio.wait_for(reader.readexactly(length), 5)


async def closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server still sends before it closes (fails if it does not in 5 s)."""
    return await asyncio.wait_for(reader.read(), 5)


async def test_over_the_cap_a_connection_gets_503_json_and_a_slot_frees_on_close() -> None:
    settings = Server(max_connections=2, header_timeout_s=30, keepalive_timeout_s=30)
    refusals: list[int] = []
    async with serving(settings, _app(), on_refused=lambda: refusals.append(1)) as (
        listeners,
        port,
    ):
        held: list[Conn] = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await until(lambda: listeners.open_connections() == 2, 5, "two open connections")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = await closed(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503 ")
        assert b"Retry-After: 1\r\n" in answer and b'"code": "too_many_connections"' in answer
        assert listeners.gates[0].refused == 1 and refusals == [1]  # counted for /metrics

        held[0][1].close()
        await until(lambda: listeners.open_connections() == 1, 5, "a slot freed")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET)
        head, body = await response(reader)
        assert head.startswith(b"HTTP/1.1 200 ") and body == b'{"pong": true}'
        writer.close()
        held[1][1].close()


async def test_headers_not_complete_in_time_get_408_and_the_connection_closes() -> None:
    settings = Server(header_timeout_s=0.1, keepalive_timeout_s=60)
    async with serving(settings, _app()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /ping HTTP/1.1\r\nHost: pro")  # half a request, then nothing
        answer = await closed(reader)  # keep-alive (60 s) would not close it within 5 s
        assert answer.startswith(b"HTTP/1.1 408 ") and b'"code": "header_timeout"' in answer
        writer.close()


async def test_header_timeout_spares_slow_handlers_and_applies_again_to_the_next_request() -> None:
    settings = Server(header_timeout_s=0.1, keepalive_timeout_s=60)
    async with serving(settings, _app(handler_delay_s=0.4)) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET)
        head, _body = await response(reader)
        assert head.startswith(b"HTTP/1.1 200 ")  # the handler ran 4x the header timeout
        writer.write(b"GET /ping HTTP/1.1\r\n")  # the next request stalls in its headers
        assert (await closed(reader)).startswith(b"HTTP/1.1 408 ")
        writer.close()


async def test_idle_keep_alive_connections_close_after_the_keepalive_timeout() -> None:
    settings = Server(header_timeout_s=60, keepalive_timeout_s=0.1)
    async with serving(settings, _app()) as (listeners, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET)
        head, _body = await response(reader)
        assert head.startswith(b"HTTP/1.1 200 ")
        assert await closed(reader) == b""  # idle after its answer: closed, nothing more sent
        silent, silent_writer = await asyncio.open_connection("127.0.0.1", port)
        assert await closed(silent) == b""  # never sent a byte
        await until(lambda: listeners.open_connections() == 0, 5, "no connection left")
        writer.close()
        silent_writer.close()


def test_open_files_soft_limit_is_raised_to_the_hard_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, hard, 256)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        with caplog.at_level(logging.INFO, logger="tierproxy"):
            got = raise_open_files_limit()
        assert got == resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
        assert f"open files limit: {hard} (hard {hard})" in caplog.text
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_header_timeouts_are_spread_over_the_last_quarter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Connections opened in one burst must not all time out in one loop iteration: each timer
    falls in [0.75, 1] x header_timeout_s (here pinned to its earliest end, 0.75 x 4 s)."""
    monkeypatch.setattr("proxy.server.listeners.random.random", lambda: 1.0)
    settings = Server(header_timeout_s=4.0, keepalive_timeout_s=60)
    async with serving(settings, _app()) as (_, port):
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        opened = loop.time()
        assert (await closed(reader)).startswith(b"HTTP/1.1 408 ")
        waited = loop.time() - opened
        assert 2.9 <= waited < 3.8, waited  # 3 s, not the full 4 s
        writer.close()
