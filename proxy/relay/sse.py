"""Reading server-sent events (an OpenAI-style stream) from an aiohttp response.

One reader for the proxy's relay, the bench's client, the plugin scenarios and the tests:
events are cut at the blank line that ends them, never at chunk boundaries.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

import aiohttp

DONE = b"[DONE]"  # the data of OpenAI's last event


async def read_events(lines: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """Complete events, each ending in a blank line, from a stream of lines (as
    ``resp.content`` yields them). A trailing event without its blank line (the stream was cut)
    is yielded with a newline added; trailing blank lines alone are not an event."""
    pending: list[bytes] = []
    async for line in lines:
        pending.append(line)
        if line in (b"\n", b"\r\n"):
            yield b"".join(pending)
            pending.clear()
    if pending and b"".join(pending).strip():
        yield b"".join(pending) + b"\n"


def events(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """Complete events of a streaming response, as they arrive."""
    return read_events(resp.content)


def event_data(event: bytes) -> bytes | None:
    """The ``data`` field of one event (its data lines joined by newlines, as the SSE spec
    says), or None when it has none (a comment or keep-alive)."""
    parts: list[bytes] = []
    for line in event.splitlines():
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(parts) if parts else None


async def data_of(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The data of each event of a streaming response, ``DONE`` included; events without data
    are skipped."""
    async for event in events(resp):
        data = event_data(event)
        if data is not None:
            yield data


class EventTooLarge(Exception):
    """An event (or a run of bytes without the blank line that ends one) passed the limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"an event of the stream passed {limit} bytes without ending")
        self.limit = limit


async def read_events_bounded(
    chunks: AsyncIterable[bytes], max_event_bytes: int
) -> AsyncIterator[bytes]:
    """``read_events`` over raw chunks (any cut), holding at most ``max_event_bytes`` of an
    unfinished event: past it, ``EventTooLarge``. Lines end at ``\\n`` as aiohttp's readline
    cuts them, so the events are the same as ``read_events`` gives."""
    buf = bytearray()
    line_start = 0  # where the line being read begins, in buf
    for_scan = 0  # bytes of buf already searched for a newline
    async for chunk in chunks:
        buf += chunk
        while (nl := buf.find(b"\n", max(line_start, for_scan))) >= 0:
            line = nl + 1 - line_start
            blank = line == 1 or (line == 2 and buf[line_start] == 0x0D)
            line_start = for_scan = nl + 1
            if blank:
                if line_start > max_event_bytes:
                    raise EventTooLarge(max_event_bytes)
                yield bytes(buf[:line_start])
                del buf[:line_start]
                line_start = for_scan = 0
        for_scan = len(buf)
        if len(buf) > max_event_bytes:
            raise EventTooLarge(max_event_bytes)
    if buf.strip():
        yield bytes(buf) + b"\n"


def bounded_events(resp: aiohttp.ClientResponse, max_event_bytes: int) -> AsyncIterator[bytes]:
    """Complete events of a streaming response, none held past ``max_event_bytes``."""
    return read_events_bounded(resp.content.iter_any(), max_event_bytes)
