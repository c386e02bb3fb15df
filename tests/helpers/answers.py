"""Reading and checking the proxy's answers in the adversarial tests."""

from __future__ import annotations

import asyncio

import orjson


def assert_openai_error(status: int, content_type: str, raw: bytes) -> dict[str, object]:
    """``raw`` is an OpenAI-shaped error served as JSON; returns its error object."""
    assert content_type.split(";")[0].strip() == "application/json", (status, raw[:300])
    body = orjson.loads(raw)
    assert set(body) == {"error"}, body
    error: dict[str, object] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"], body
    return error


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    """One HTTP answer (after any 1xx): status, headers (lower-case names), body framed by
    Content-Length, chunks or the close."""
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status >= 200:
            break
    headers = {}
    for line in head[:-4].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if b"content-length" in headers:
        return status, headers, await reader.readexactly(int(headers[b"content-length"]))
    if headers.get(b"transfer-encoding") == b"chunked":
        body = bytearray()
        while size := int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16):
            body += await reader.readexactly(size)
            await reader.readexactly(2)
        await reader.readuntil(b"\r\n")
        return status, headers, bytes(body)
    return status, headers, await reader.read()
