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
