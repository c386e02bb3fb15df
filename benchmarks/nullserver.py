"""A fast null OpenAI backend for the overhead benchmark: fixed answers, no model.

Raw asyncio protocol (uvloop when installed), HTTP/1.1 keep-alive: an aiohttp server (the fake
of proxy/bench/fake_vllm.py) would measure itself at wrk's rates; the answers are that module's.
POST /v1/chat/completions answers a fixed chat completion, or, when the body asks
``"stream": true``, a fixed SSE stream: ``burst`` writes the whole stream at once; ``paced``
writes one event per tick to every open stream, as vLLM writes one event per decode step for
each running request.

    python benchmarks/nullserver.py --port 18100 [--paced-gap-ms 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re

from proxy.bench.vllm_answers import (
    NULL_MODEL,
    models_list,
    null_completion,
    null_stream_events,
)
from proxy.ops.runtime import run  # uvloop where installed

MODELS = models_list(NULL_MODEL)
_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)
_STREAM = re.compile(rb'"stream"\s*:\s*true')


def _fixed(status: bytes, ctype: bytes, body: bytes) -> bytes:
    head = b"HTTP/1.1 " + status + b"\r\ncontent-type: " + ctype
    return head + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


class Answers:
    def __init__(self, gap_s: float) -> None:
        self.gap_s = gap_s
        events = null_stream_events()
        self.events = [_chunked(e) for e in events]
        self.burst = b"".join(self.events) + b"0\r\n\r\n"
        self.stream_head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        self.json = _fixed(b"200 OK", b"application/json", null_completion())
        self.models = _fixed(b"200 OK", b"application/json", MODELS)
        self.empty = _fixed(b"200 OK", b"text/plain", b"")
        self.missing = _fixed(b"404 Not Found", b"text/plain", b"")
        # paced streams: transport -> index of its next event
        self.open: dict[asyncio.Transport, int] = {}
        self.waiting: dict[asyncio.Transport, list[bytes]] = {}

    def tick(self) -> None:
        done = []
        for transport, at in self.open.items():
            if transport.is_closing():
                done.append(transport)
                continue
            data = self.events[at]
            if at + 1 == len(self.events):
                data += b"0\r\n\r\n"
                done.append(transport)
            else:
                self.open[transport] = at + 1
            transport.write(data)
        for transport in done:
            del self.open[transport]
            queued = self.waiting.pop(transport, None)
            if queued:  # pipelined requests behind the stream
                for request in queued:
                    NullProtocol.answer(self, transport, request)


class NullProtocol(asyncio.Protocol):
    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        while (end := buf.find(b"\r\n\r\n")) >= 0:
            match = _LENGTH.search(buf, 0, end + 2)
            total = end + 4 + (int(match.group(1)) if match else 0)
            if len(buf) < total:
                break
            request, buf = buf[:total], buf[total:]
            assert self.transport is not None
            if self.transport in self.answers.open:
                self.answers.waiting.setdefault(self.transport, []).append(request)
            else:
                self.answer(self.answers, self.transport, request)
        self.buf = buf

    @staticmethod
    def answer(answers: Answers, transport: asyncio.Transport, request: bytes) -> None:
        line = request[: request.find(b"\r\n")]
        if line.startswith(b"POST /v1/chat/completions"):
            if _STREAM.search(request, request.find(b"\r\n\r\n")):
                if answers.gap_s <= 0:
                    transport.write(answers.stream_head + answers.burst)
                else:
                    transport.write(answers.stream_head)
                    answers.open[transport] = 0
            else:
                transport.write(answers.json)
        elif line.startswith(b"GET /v1/models"):
            transport.write(answers.models)
        elif line.startswith((b"GET /health", b"GET /metrics")):
            transport.write(answers.empty)
        else:
            transport.write(answers.missing)


async def serve(port: int, gap_s: float) -> None:
    loop = asyncio.get_running_loop()
    answers = Answers(gap_s)
    server = await loop.create_server(lambda: NullProtocol(answers), "127.0.0.1", port)
    async with server:
        if gap_s <= 0:
            await server.serve_forever()
        while True:
            await asyncio.sleep(gap_s)
            answers.tick()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--paced-gap-ms", type=float, default=0.0, help="0: burst")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        run(serve(args.port, args.paced_gap_ms / 1000))


if __name__ == "__main__":
    main()
