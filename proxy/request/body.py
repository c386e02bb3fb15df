"""Reading a client's request body: bounded in size and time, decoded from its Content-Encoding.

The proxy decodes the body itself (the app turns aiohttp's own request decompression off, which
answered unsupported encodings in plain text before any handler ran): gzip and deflate with the
decoded size bounded by the same limit as the body (a gzip bomb stops at ``limit + 1`` bytes),
anything else 415. What goes on to the backend is always the identity JSON the proxy writes.
"""

from __future__ import annotations

import asyncio
import zlib

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from proxy.api.errors import ProxyError, memory_full, too_large
from proxy.api.input_errors import (
    bad_encoding,
    bad_framing,
    body_timeout,
    too_many_members,
    unsupported_encoding,
)
from proxy.config.server import InputLimits
from proxy.relay.budget import Reservation, held_estimate

_CHUNK = 64 * 1024


async def read_body(
    request: web.Request,
    limit: int,
    inputs: InputLimits | None = None,
    held: Reservation | None = None,
) -> bytes:
    """The decoded body, refused with 413 as soon as it (or its decoding) passes ``limit``, with
    408 when it does not arrive within the knob's time, 415/400 for encodings it cannot decode.
    ``held``: the request's share of the memory budget, grown to the body's estimate as its
    bytes arrive (never by what Content-Length announces: idle connections announcing 8 MiB
    each held the whole budget, issue 22 #3); 503 where it does not fit."""
    inputs = inputs or InputLimits()
    # Checked before reading: an unsupported encoding is refused without waiting for the body.
    encodings = content_encodings(request.headers.get("Content-Encoding", ""))
    for encoding in encodings:
        if encoding not in inputs.decode_content_encodings:
            raise unsupported_encoding(encoding, list(inputs.decode_content_encodings))
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    raw = await _read_raw(request, limit, inputs.body_read_timeout_s, held)
    for encoding in reversed(encodings):  # the last one listed was applied last
        raw = decode(raw, encoding, limit)
    _cover(held, len(raw))  # the decoded body is what gets parsed
    return raw


def _cover(held: Reservation | None, body_bytes: int) -> None:
    """Grow ``held`` to the estimate of a ``body_bytes`` body, or refuse the request (503)."""
    if held is None:
        return
    missing = held_estimate(body_bytes) - held.amount
    if missing > 0 and not held.grow(missing):
        raise memory_full()


def content_encodings(header: str) -> list[str]:
    """The codings named by a Content-Encoding header, identity left out."""
    names = [part.strip().lower() for part in header.split(",")]
    return [name for name in names if name and name != "identity"]


async def _read_raw(
    request: web.Request, limit: int, timeout_s: float, held: Reservation | None
) -> bytes:
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_chunked(_CHUNK):
                body += chunk
                if len(body) > limit:
                    raise too_large(limit)
                _cover(held, len(body))  # reserved as it arrives, not as announced
    except TimeoutError:
        raise body_timeout(timeout_s) from None
    except HttpProcessingError as exc:  # bad chunked framing, short Content-Length, ...
        raise bad_framing(str(exc.message or exc)) from None
    except RequestPayloadError as exc:  # the C parser wraps what failed in a body in this
        raise bad_framing(str(exc).splitlines()[-1].strip()[:200]) from None
    except (ConnectionError, EOFError):
        raise ProxyError(400, "The connection closed before the body was complete.") from None
    return bytes(body)


# A gzip body may be several members one after the other (RFC 1952); clients send one. Each
# member costs a decoder and a pass, so a body of 150k empty 20-byte members was quadratic work
# on the event loop (issue 22 #2): a few are allowed, more is refused.
MAX_GZIP_MEMBERS = 16
# Input fed to a decoder at a time: what zlib copies into ``unused_data`` at a member's end is at
# most this, not the rest of the body.
_DECODE_WINDOW = 64 * 1024


def decode(data: bytes, encoding: str, limit: int) -> bytes:
    """``data`` decoded from gzip or deflate (zlib-wrapped or raw, as clients send both). Linear
    in ``len(data)`` and the decoded size (at most ``limit + 1`` bytes are decoded)."""
    if encoding == "gzip":
        wbits = 31
    elif len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0:
        wbits = 15  # a zlib header
    else:
        wbits = -15  # raw deflate
    view = memoryview(data)
    out = bytearray()
    offset = 0  # where the next member starts
    members = 0
    try:
        while True:
            members += 1
            if members > MAX_GZIP_MEMBERS:
                raise too_many_members(encoding, MAX_GZIP_MEMBERS)
            decoder = zlib.decompressobj(wbits)
            while not decoder.eof:
                if offset >= len(view):
                    raise bad_encoding(encoding)  # truncated
                piece = view[offset : offset + _DECODE_WINDOW]
                out += decoder.decompress(piece, limit + 1 - len(out))
                if len(out) > limit or decoder.unconsumed_tail:
                    raise too_large(limit)
                offset += len(piece) - len(decoder.unused_data)
            if offset >= len(view) or wbits != 31:
                break
    except zlib.error:
        raise bad_encoding(encoding) from None
    if offset < len(view):
        raise bad_encoding(encoding)  # bytes after the end of the compressed data
    return bytes(out)
