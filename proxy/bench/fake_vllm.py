"""The one fake vLLM OpenAI server, for what a real engine cannot show on demand (a backend that
hangs, dies mid-stream, answers 503, holds a request until the test lets it go, cuts a
Responses stream) and for measuring the proxy's own cost (answers at once, or after a set time
per token as an engine's decode would take). Never a stand-in for anything real vLLM can show:
the integration tests run vLLM itself.

Every route the proxy sends on (``proxy.api.routes.POST_PATHS``) plus vLLM's probes (``/health``,
``/version``, ``/v1/models``, ``/metrics``), answered in vLLM's shapes. It counts what it
received, served and had hung up on. The answer builders (``chat_completion``, ``chat_chunk``,
``models_list``, in ``proxy.bench.vllm_answers``) are also what ``benchmarks/nullserver.py``
writes on its raw wire.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDictProxy

from proxy.api.routes import POST_PATHS
from proxy.bench.inproc import serve_app
from proxy.bench.vllm_answers import (
    DONE,
    ENGINE_DEAD,
    METRICS_PADDING,
    chat_chunk,
    generation,
    models_list,
    responses_event,
    responses_usage,
    usage_of,
)

# The test's own answer to the n-th request (from 1): for byte-level faults no setting covers;
# None: the configured answer.
Script = Callable[[web.Request, int], Awaitable[web.StreamResponse | None]]


@dataclass(frozen=True)
class Received:
    path: str
    headers: CIMultiDictProxy[str]
    body: dict[str, Any]


class FakeVLLM:
    """A vLLM server whose answers a test sets.

    ``status``: 200, or an error status answered with a vLLM-shaped error body (e.g. 503).
    ``usage``: (prompt, completion) tokens it reports. ``delay_s`` before every answer, plus
    ``delay_per_token_s`` times the request's ``max_tokens``. ``gate``: while cleared, requests
    wait at the backend before any byte of the answer. ``hang``: every route (probes too)
    accepts and never answers. ``die_after_events``: a generation streams that many events, then
    the connection drops without ``[DONE]``. ``cut_responses_stream``: a Responses stream ends
    before ``response.completed``. ``end_delay_s``: between a stream's last event and the end of
    its body (vLLM's end of body comes apart from ``[DONE]``). ``tokenize_status``: else
    ``/tokenize`` answers this status.
    ``tokenize_gate``: set, ``/tokenize`` and ``/detokenize`` wait for it (a busy tokenizer;
    ``tokenizing`` counts the waiting). ``script``: the test's own answer to every POST (None
    from it: the configured answer). ``version_calls`` counts ``GET /version``. ``poison``: a
    chat whose first message is this kills the engine (``dead``): vLLM's EngineDeadError 500 to
    it and every later POST, ``/health`` 500. ``metrics_padding_bytes``: ``/metrics`` streams
    that much (a broken exporter) before ``metrics_text``.
    Serve it with ``serve()``: a caller hanging up cancels its handler, counted in ``hung_up``.
    """

    def __init__(
        self,
        *,
        model: str = "tiny",
        status: int = 200,
        usage: tuple[int, int] = (7, 3),
        delay_s: float = 0.0,
        delay_per_token_s: float = 0.0,
        hang: bool = False,
        die_after_events: int | None = None,
        cut_responses_stream: bool = False,
        end_delay_s: float = 0.0,
        tokenize_status: int = 200,
        tokenize_gate: asyncio.Event | None = None,
        script: Script | None = None,
        metrics_text: str = "",
        stream_chunks: int = 0,
        chunk_tokens: int = 1,
        cut_before_usage: bool = False,
        pad_bytes: int = 0,
        poison: str | None = None,
        metrics_padding_bytes: int = 0,
    ) -> None:
        self.model = model
        self.status = status
        self.usage = usage
        self.delay_s = delay_s
        self.delay_per_token_s = delay_per_token_s
        self.hang = hang
        self.die_after_events = die_after_events
        self.cut_responses_stream = cut_responses_stream
        self.end_delay_s = end_delay_s
        self.tokenize_status = tokenize_status
        self.tokenize_gate = tokenize_gate
        self.script = script
        self.metrics_text = metrics_text
        # What real vLLM cannot be made to show on demand (billing tests): a stream of
        # ``stream_chunks`` chunks a choice (0: one "ok") of ``chunk_tokens`` tokens each
        # (--stream-interval, speculative decoding, a lagging reader), its usage counting
        # them all; ``cut_before_usage``: the connection drops after the last one (no usage
        # chunk, no [DONE]); ``pad_bytes``: a non-stream answer that large, its usage at the end.
        self.stream_chunks = stream_chunks
        self.chunk_tokens = chunk_tokens
        self.cut_before_usage = cut_before_usage
        self.pad_bytes = pad_bytes
        self.poison = poison
        self.dead = False
        self.metrics_padding_bytes = metrics_padding_bytes
        # Its card's context: past the longest answer a test streams (vLLM refuses a
        # max_tokens past it, and so does the proxy once it read the card).
        self.max_model_len = 65_536
        self.gate = asyncio.Event()
        self.gate.set()
        self.received: list[Received] = []
        self.served = 0  # generations answered in full
        self.served_by_user: dict[str, int] = {}  # by the body's "user" field
        self.active = 0  # requests in a handler now
        self.max_active = 0
        self.hung_up = 0  # handlers cancelled (or reset) by the caller leaving
        self.tokenizing = 0  # tokenizer calls waiting at ``tokenize_gate`` now
        self.version_calls = 0

    def app(self) -> web.Application:
        app = web.Application()
        if self.hang:
            app.router.add_route("*", "/{tail:.*}", self._hang)
            return app
        app.router.add_get("/health", self._empty)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        for path in POST_PATHS:
            app.router.add_post(path, self._post)
        return app

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        """Serve on a free loopback port; yields the base URL."""
        async with serve_app(self.app(), handler_cancellation=True) as url:
            yield url

    def usage_body(self) -> dict[str, int]:
        return usage_of(*self.usage)

    async def _hang(self, request: web.Request) -> web.Response:
        await asyncio.sleep(3600)  # accepts, reads nothing, never answers (cancelled on close)
        return web.Response()

    async def _empty(self, request: web.Request) -> web.Response:
        return web.Response(text="", status=500 if self.dead else 200)

    async def _version(self, request: web.Request) -> web.Response:
        self.version_calls += 1
        return web.json_response({"version": "0.32.0"})

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        if not self.metrics_padding_bytes:
            return web.Response(text=self.metrics_text)
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        with contextlib.suppress(ConnectionResetError):  # the proxy cuts it at its cap
            for _ in range(self.metrics_padding_bytes // len(METRICS_PADDING)):
                await resp.write(METRICS_PADDING)
            await resp.write(self.metrics_text.encode())
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        body = models_list(self.model, self.max_model_len)
        return web.Response(body=body, content_type="application/json")

    async def _post(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body: dict[str, Any] = orjson.loads(raw) if raw else {}
        self.received.append(Received(request.path, request.headers, body))
        n = len(self.received)
        if self.dead or self._is_poison(body):
            self.dead = True
            return web.Response(body=ENGINE_DEAD, status=500, content_type="application/json")
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await self.gate.wait()
            scripted = await self.script(request, n) if self.script is not None else None
            if scripted is not None:
                return scripted
            answer = await self._answer(request, body)
            self.served += 1
            user = str(body.get("user", ""))
            self.served_by_user[user] = self.served_by_user.get(user, 0) + 1
            return answer
        except (asyncio.CancelledError, ConnectionResetError):
            self.hung_up += 1
            raise
        finally:
            self.active -= 1

    def _is_poison(self, body: dict[str, Any]) -> bool:
        messages = body.get("messages")
        first = messages[0] if isinstance(messages, list) and messages else None
        return (
            self.poison is not None
            and isinstance(first, dict)
            and first.get("content") == self.poison
        )

    async def _answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        path = request.path
        # Whatever the field holds (the proxy forwards what vLLM itself would judge), a fake
        # never fails on it: only a plain number scales the delay.
        tokens = body.get("max_tokens")
        per_token = float(tokens) if isinstance(tokens, int | float) else 0.0
        delay = self.delay_s + self.delay_per_token_s * per_token
        if delay:
            await asyncio.sleep(delay)
        if path in ("/tokenize", "/detokenize"):
            if path == "/tokenize" and self.tokenize_status != 200:
                return _error(self.tokenize_status, "BadRequestError")
            if self.tokenize_gate is not None:
                self.tokenizing += 1
                try:
                    await self.tokenize_gate.wait()
                finally:
                    self.tokenizing -= 1
            return web.json_response({"count": 2, "tokens": [1, 2], "max_model_len": 2048})
        if self.status != 200:
            return _error(self.status, "server_error")
        if self.die_after_events is not None and path in GENERATIONS:
            return await self._die_mid_stream(request)
        stream = body.get("stream") is True
        if path == "/v1/responses":
            return await (self._responses_stream(request) if stream else self._responses())
        if path in GENERATIONS:
            if stream and self.stream_chunks:
                return await self._token_stream(request, body)
            if stream:
                return await self._generation_stream(request, body)
            return web.Response(
                body=generation(path, self.model, self.usage_body(), self.pad_bytes),
                content_type="application/json",
            )
        prompt, _ = self.usage  # pooling, scoring: no completion tokens
        usage = {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0}
        return web.json_response({"object": "list", "data": [], "usage": usage})

    async def _token_stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        """``stream_chunks`` chunks of ``chunk_tokens`` tokens for each of ``n`` choices,
        interleaved as vLLM sends them; then the usage chunk, or a dropped connection."""
        resp = await _sse(request)
        choices_asked = body.get("n")
        n = choices_asked if isinstance(choices_asked, int) else 1
        text = "tok " * self.chunk_tokens
        chat = request.path == "/v1/chat/completions"
        for _ in range(self.stream_chunks):
            choices = [
                {"index": i, "delta": {"content": text}} if chat else {"index": i, "text": text}
                for i in range(n)
            ]
            for choice in choices:
                await resp.write(chat_chunk(self.model, [{**choice, "finish_reason": None}]))
        if self.cut_before_usage:
            await asyncio.sleep(0.05)  # what was written reaches the proxy first
            assert request.transport is not None
            request.transport.abort()
            return resp
        completion = self.stream_chunks * self.chunk_tokens * n
        usage = usage_of(self.usage[0], completion)
        await resp.write(chat_chunk(self.model, [], usage=usage))
        await resp.write(DONE)
        await self._end(resp)
        return resp

    async def _generation_stream(
        self, request: web.Request, body: dict[str, Any]
    ) -> web.StreamResponse:
        resp = await _sse(request)
        if request.path == "/v1/chat/completions":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": "ok"}}
        else:
            choice = {"index": 0, "text": "ok"}
        await resp.write(chat_chunk(self.model, [{**choice, "finish_reason": "stop"}]))
        if (body.get("stream_options") or {}).get("include_usage"):  # as vLLM: only if asked
            await resp.write(chat_chunk(self.model, [], usage=self.usage_body()))
        await resp.write(DONE)
        await self._end(resp)
        return resp

    async def _end(self, resp: web.StreamResponse) -> None:
        if self.end_delay_s:
            await asyncio.sleep(self.end_delay_s)
        await resp.write_eof()

    async def _die_mid_stream(self, request: web.Request) -> web.StreamResponse:
        resp = await _sse(request)
        for i in range(self.die_after_events or 0):
            delta = {"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}
            await resp.write(chat_chunk(self.model, [delta]))
            await asyncio.sleep(0.01)  # separate events on the wire
        assert request.transport is not None
        request.transport.abort()  # the connection drops without [DONE]
        return resp

    async def _responses(self) -> web.Response:
        usage = responses_usage(*self.usage)
        return web.json_response({"object": "response", "usage": usage})

    async def _responses_stream(self, request: web.Request) -> web.StreamResponse:
        resp = await _sse(request)
        created = {"type": "response.created", "response": {"status": "in_progress"}}
        await resp.write(responses_event("response.created", created))
        text = "tok " * self.chunk_tokens if self.stream_chunks else "ok"
        delta = {"type": "response.output_text.delta", "delta": text}
        for _ in range(self.stream_chunks or 1):
            await resp.write(responses_event("response.output_text.delta", delta))
        if not self.cut_responses_stream:
            done = {
                "type": "response.completed",
                "response": {"usage": responses_usage(*self.usage)},
            }
            await resp.write(responses_event("response.completed", done))
        await self._end(resp)
        return resp


GENERATIONS = ("/v1/chat/completions", "/v1/completions")


def _error(status: int, kind: str) -> web.Response:
    error = {"message": "scripted", "type": kind, "param": None, "code": status}
    return web.json_response({"error": error}, status=status)


async def _sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    return resp
