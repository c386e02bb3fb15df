"""What aiohttp's HTTP parser refuses, answered by the proxy (``GuardedHandler.handle_error``)
as OpenAI-shaped JSON with ``Connection: close`` and one log line, never aiohttp's plain text
and traceback; raw sockets against the real app on production's listeners."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import KEYS, make_config, running_proxy
from tests.helpers.answers import assert_openai_error, read_answer

KEY = f"Authorization: Bearer {KEYS['low']}\r\n".encode()
CHAT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n" + KEY
GET = b"GET /healthz HTTP/1.1\r\nHost: proxy\r\n"

MALFORMED: dict[str, tuple[bytes, int]] = {
    "garbage request line": (b"GARBAGE\r\n\r\n", 400),
    "bad method": (b"G@T / HTTP/1.1\r\nHost: proxy\r\n\r\n", 400),
    "bad version": (b"GET / HTTP/9.9\r\nHost: proxy\r\n\r\n", 400),
    "TLS on the HTTP port": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\0" * 40, 400),
    "HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
    "bare LF line ends": (b"GET /healthz HTTP/1.1\nHost: proxy\n\n", 400),
    "bad byte in the path": (b"GET /he\xffalthz HTTP/1.1\r\nHost: proxy\r\n\r\n", 400),
    "header name with a space": (GET + b"Bad Name: v\r\n\r\n", 400),
    "header without a colon": (GET + b"NoColon\r\n\r\n", 400),
    "control byte in a value": (GET + b"X-A: a\x01b\r\n\r\n", 400),
    "NUL in a value": (GET + b"X-A: a\x00b\r\n\r\n", 400),
    "obsolete line folding": (GET + b"X-A: a\r\n b\r\n\r\n", 400),
    "missing Host": (b"GET /healthz HTTP/1.1\r\n\r\n", 400),
    "header over 8190 bytes": (GET + b"X-A: " + b"a" * 9000 + b"\r\n\r\n", 431),
    "over 128 headers": (GET + b"".join(b"X-%d: v\r\n" % i for i in range(200)) + b"\r\n", 431),
    "request line over 8190 bytes": (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 431),
    "Content-Length not a number": (CHAT + b"Content-Length: abc\r\n\r\n{}", 400),
    "negative Content-Length": (CHAT + b"Content-Length: -1\r\n\r\n{}", 400),
    "two Content-Lengths": (CHAT + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
    "Content-Length and chunked": (
        CHAT + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
        400,
    ),
    "Transfer-Encoding not chunked": (CHAT + b"Transfer-Encoding: gzip\r\n\r\n{}", 400),
    "bad chunk size": (CHAT + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400),
    "chunk size overflow": (
        CHAT + b"Transfer-Encoding: chunked\r\n\r\n" + b"f" * 20 + b"\r\n{}\r\n0\r\n\r\n",
        400,
    ),
    # Found by the fuzz: aiohttp's Expect check, before any middleware, failed to encode it.
    "a header that is not UTF-8": (GET + b"Expect: \x80\r\n\r\n", 400),
    "no CRLF after chunk data": (
        CHAT + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}XX0\r\n\r\n",
        400,
    ),
}


@contextlib.asynccontextmanager
async def proxy_port() -> AsyncIterator[int]:
    async with (
        FakeVLLM().serve() as url,
        running_proxy(make_config([{"url": url}])) as (base, _),
    ):
        yield int(base.rsplit(":", 1)[1])


async def exchange(port: int, *parts: bytes) -> tuple[int, dict[bytes, bytes], bytes, bytes]:
    """Send ``parts`` (a pause between them); the answer and what follows it until the close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i, part in enumerate(parts):
            if i:
                await asyncio.sleep(0.05)  # the parts arrive apart, as separate reads
            writer.write(part)
        async with asyncio.timeout(30):  # against hanging
            status, headers, body = await read_answer(reader)
            rest = await reader.read()  # b"" once the proxy has closed the connection
        return status, headers, body, rest
    finally:
        writer.close()


@pytest.fixture
async def port() -> AsyncIterator[int]:
    async with proxy_port() as bound:
        yield bound


async def test_every_parser_error_is_json_with_connection_close(
    port: int, caplog: pytest.LogCaptureFixture
) -> None:
    for name, (data, expected) in MALFORMED.items():
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            status, headers, body, rest = await exchange(port, data)
        assert status == expected, (name, status, body)
        error = assert_openai_error(status, headers[b"content-type"].decode(), body)
        assert error["type"] == "invalid_request_error"
        assert error["code"] == (
            "malformed_request" if expected == 400 else "request_header_fields_too_large"
        ), name
        assert headers.get(b"connection") == b"close", name
        assert rest == b"", name  # and it is closed
        # One line per refusal, never a traceback (a client must not flood the log).
        assert all(r.exc_info is None for r in caplog.records), name
        mine = [r for r in caplog.records if "malformed request" in r.getMessage()]
        assert len(mine) == 1, (name, [r.getMessage() for r in caplog.records])


async def test_bad_chunk_framing_inside_a_body_fails_that_body_at_once(port: int) -> None:
    """The headers and a first chunk arrive, the handler starts reading, then a bad chunk: a
    400 bad_framing at once (aiohttp left the body waiting for the body timeout, 30 s)."""
    head = CHAT + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n"
    started = asyncio.get_running_loop().time()
    status, headers, body, rest = await exchange(port, head, b"zz\r\nxx\r\n0\r\n\r\n")
    # At once (ms), not at the body timeout (30 s): a third of it tells them apart on any load.
    assert asyncio.get_running_loop().time() - started < 10
    error = assert_openai_error(status, headers[b"content-type"].decode(), body)
    assert status == 400 and error["code"] == "bad_framing", body
    assert "chunk size" in str(error["message"]) and "^" not in str(error["message"])
    assert rest == b""  # one answer, then the connection closes


async def test_a_good_request_after_a_refused_connection_is_served(port: int) -> None:
    await exchange(port, b"GARBAGE\r\n\r\n")
    status, _, body, _ = await exchange(port, GET + b"Connection: close\r\n\r\n")
    assert status == 200 and body == b'{"status": "ok"}'
