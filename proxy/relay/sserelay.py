"""What to forward of a streamed answer, a read at a time (no I/O here).

The relay forwards what arrived in one read as one write: the complete events of the read, in
order and byte for byte; an unfinished event waits for the rest. Most reads hold only token
events, and those pass with a few byte searches (``bytes.find`` and ``in``, in C) instead of a
Python step per line and per event. A read is taken apart event by event only where one of its
events needs something: the usage chunk (kept, stripped when the client did not ask for it),
an error event, and, while the usage chunk is being stripped, a terminal chunk.

vLLM stamps ``system_fingerprint`` on the terminal chunks (a ``finish_reason``) only without
``include_usage``; with it (the proxy always asks), the usage chunk carries it instead. So that
the client's stream is what vLLM sends without ``include_usage``, the terminal chunks wait for
the usage chunk and get its fingerprint. Only they wait: with ``n`` > 1 the other choices'
tokens pass as they come (each choice's own events stay in order: nothing of a choice follows
its terminal chunk), and what waits is bounded (``MAX_HELD_BYTES``: past it the terminal chunks
go on without the fingerprint). They go out before ``[DONE]`` in any case (a client stops
reading there), or at the stream's end when none came (``finish``, ``take_held``).

The stream ends at its ``[DONE]`` event: an event whose data (its ``data:`` lines joined by
``\\n``, as the SSE spec reads them) is exactly ``[DONE]``. What follows it, in the same read
or later ones, is neither forwarded nor looked at (a usage chunk there is not billed). A block
without the bytes ``[DONE]`` (one search, in C) needs no more; one with them is cut at the
event that holds them, and that event's data compared.

Events end at a blank line; lines end at ``\\n`` (as aiohttp's readline and ``proxy.relay.sse`` cut
them). An event longer than ``max_event_bytes`` raises ``EventTooLarge``.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.relay.sse import DONE, EventTooLarge, event_data

_USAGE_MARK = b'"choices":[]'
_ERROR_MARK = b'"error"'
_FINISH_MARK = b'"finish_reason":"'  # a terminal chunk: finish_reason is not null
_FINGERPRINT = b'"system_fingerprint":'
# Terminal chunks held for the fingerprint: n (at most 128) chunks of a few hundred bytes.
MAX_HELD_BYTES = 64 * 1024


def split_events(block: bytes) -> list[bytes]:
    """The events of a block that ends at an event's end, each with its blank line."""
    events = []
    start = line_start = 0
    while (nl := block.find(b"\n", line_start)) >= 0:
        size = nl + 1 - line_start
        blank = size == 1 or (size == 2 and block[line_start] == 0x0D)
        line_start = nl + 1
        if blank:
            events.append(block[start:line_start])
            start = line_start
    if start < len(block):
        events.append(block[start:])
    return events


def _last_event_end(data: bytes) -> int:
    """Where the last complete event of ``data`` ends (0: none)."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


def _event_end(block: bytes, start: int) -> int:
    """Where the event starting at ``start`` ends (after its blank line; the block's end when
    it has none)."""
    line_start = start
    while (nl := block.find(b"\n", line_start)) >= 0:
        size = nl + 1 - line_start
        line_start = nl + 1
        if size == 1 or (size == 2 and block[nl - 1] == 0x0D):
            return line_start
    return len(block)


def done_event(block: bytes) -> tuple[int, int] | None:
    """Where the first ``[DONE]`` event of a block of whole events starts and ends; None when
    it has none (``[DONE]`` inside a token's text or as one data line of several is not one)."""
    at = block.find(DONE)
    while at >= 0:
        start = _last_event_end(block[:at])
        end = _event_end(block, start)
        if event_data(block[start:end]) == DONE:
            return start, end
        at = block.find(DONE, end)
    return None


def _json_of(event: bytes) -> Any:
    data = event.strip()
    if not data.startswith(b"data:"):
        return None
    try:
        return orjson.loads(data[5:])
    except orjson.JSONDecodeError:
        return None


def is_usage_chunk(event: bytes) -> bool:
    return _USAGE_MARK in event and b'"usage"' in event


def is_error_event(event: bytes) -> bool:
    """OpenAI's error shape (``{"error": {...}}``) or vLLM's older flat one."""
    if _ERROR_MARK not in event:
        return False
    parsed = _json_of(event)
    return isinstance(parsed, dict) and ("error" in parsed or parsed.get("object") == "error")


def _client_code(event: bytes) -> bool:
    parsed = _json_of(event)
    error = parsed.get("error") if isinstance(parsed, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return isinstance(code, int) and 400 <= code < 500


def with_fingerprint(event: bytes, fingerprint: bytes) -> bytes:
    """A terminal chunk with vLLM's ``"system_fingerprint":...`` as its last field (where
    vLLM's serialisation puts it when nothing follows ``choices``)."""
    if _FINGERPRINT in event:
        return event
    end = event.rstrip()
    if not end.endswith(b"}"):
        return event
    return end[:-1] + b',"system_fingerprint":' + fingerprint + b"}" + event[len(end) :]


class SseRelay:
    """Feed it each read (``feed``), then the end (``finish``); forward what they return."""

    def __init__(self, max_event_bytes: int, *, strip_usage: bool) -> None:
        self.max_event_bytes = max_event_bytes
        self.strip_usage = strip_usage
        self.started = False  # a complete event has arrived (the first token, for TTFT)
        self.saw_done = False
        self.error_event = False
        # Its first event an error of a 4xx code: the engine refused it once streaming (vLLM
        # checks some fields only then: HTTP 200, the error, [DONE]), having done no work.
        self.refused = False
        self._events = 0
        self.usage: dict[str, Any] | None = None
        self._pending = b""  # the start of an unfinished event
        self._held: list[bytes] = []  # terminal chunks waiting for the usage chunk
        self._held_bytes = 0
        self._too_large = False  # an event past the bound: raised once the rest is forwarded

    def feed(self, chunk: bytes) -> bytes:
        if self.saw_done:  # the stream is over: nothing after [DONE] counts
            return b""
        if self._too_large:  # the events before it were forwarded first
            raise EventTooLarge(self.max_event_bytes)
        data = self._pending + chunk if self._pending else chunk
        end = _last_event_end(data)
        if end == 0:
            if len(data) > self.max_event_bytes:
                raise EventTooLarge(self.max_event_bytes)
            self._pending = data
            return b""
        block = data[:end] if end < len(data) else data
        self._pending = data[end:] if end < len(data) else b""
        out = self._inspect(block)
        if self.saw_done:
            self._pending = b""
        elif len(self._pending) > self.max_event_bytes:
            self._too_large = True
        if self._too_large and not out:
            raise EventTooLarge(self.max_event_bytes)
        self.started = True
        return out

    def finish(self) -> bytes:
        """What is left at the stream's end: any terminal chunk still held, then an event cut
        short (with its end added, as ``proxy.relay.sse`` gives it)."""
        if self._too_large:
            raise EventTooLarge(self.max_event_bytes)
        rest, self._pending = self._pending, b""
        out = self._inspect(rest + b"\n") if rest.strip() else b""
        return self.take_held() + out  # what was held came first

    def take_held(self) -> bytes:
        """The terminal chunks still held (without the fingerprint), to go out now: before the
        error event and ``[DONE]`` that end a stream cut short."""
        held, self._held, self._held_bytes = b"".join(self._held), [], 0
        return held

    def _inspect(self, block: bytes) -> bytes:
        if DONE in block and (done := done_event(block)) is not None:
            start, end = done
            out = self._inspect_events(block[:start]) if start else b""
            if self._too_large:  # an event before [DONE] passed the bound: raised next
                return out
            self.saw_done = True
            # Whatever is still held goes before [DONE]: a client stops reading there.
            return out + self.take_held() + block[start:end]
        return self._inspect_events(block)

    def _inspect_events(self, block: bytes) -> bytes:
        slow = (
            _USAGE_MARK in block
            or _ERROR_MARK in block
            or (self.strip_usage and _FINISH_MARK in block)
            or len(block) > self.max_event_bytes
        )
        if not slow:
            self._events += bool(block.strip())
            return block
        return self._by_event(block)

    def _by_event(self, block: bytes) -> bytes:
        out: list[bytes] = []
        if len(block) <= self.max_event_bytes:
            # The events before the first one that needs a look pass as they are.
            marks = [_USAGE_MARK, _ERROR_MARK, *([_FINISH_MARK] if self.strip_usage else [])]
            first = min((at for m in marks if (at := block.find(m)) >= 0), default=len(block))
            start = _last_event_end(block[:first])
            out.append(block[:start])
            self._events += bool(block[:start].strip())
            block = block[start:]
        for event in split_events(block):
            if len(event) > self.max_event_bytes:
                self._too_large = True
                break
            if is_usage_chunk(event):
                parsed = _json_of(event)
                usage = parsed.get("usage") if isinstance(parsed, dict) else None
                self.usage = usage if isinstance(usage, dict) else None
                if self.strip_usage:
                    fingerprint = parsed.get("system_fingerprint") if parsed else None
                    self._release(out, fingerprint)
                    continue
            elif is_error_event(event):
                self.error_event = True
                self.refused = not self._events and _client_code(event)
            self._events += 1
            if self.strip_usage and _FINISH_MARK in event:
                self._hold(event, out)
            else:
                out.append(event)
        return b"".join(out)

    def _hold(self, event: bytes, out: list[bytes]) -> None:
        """Hold a terminal chunk for the usage chunk's fingerprint; past the bound, let
        everything held go on as it is (the fingerprint is a nicety, memory is not)."""
        self._held.append(event)
        self._held_bytes += len(event)
        if self._held_bytes > MAX_HELD_BYTES:
            out.extend(self._held)
            self._held, self._held_bytes = [], 0

    def _release(self, out: list[bytes], fingerprint: object) -> None:
        if isinstance(fingerprint, str):
            mark = orjson.dumps(fingerprint)
            self._held = [with_fingerprint(e, mark) if _FINISH_MARK in e else e for e in self._held]
        out.extend(self._held)
        self._held, self._held_bytes = [], 0
