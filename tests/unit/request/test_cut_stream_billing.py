"""Streams that end without the backend's usage are billed what they delivered (issue 22's
fresh-eyes finding 4): the pipeline over an in-process backend that streams vLLM-shaped chunks
and then hangs or breaks, on the fake clock (the tokens-per-minute bucket never refills, so its
level is exactly what was charged). The served twin: tests/adversarial/served/test_billing.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.api.routes import BY_ENDPOINT
from proxy.bench.inproc import SECRET, auth, make_config, serve_app, until
from proxy.config.loader import parse_config
from proxy.policies.cost import weighted_tokens
from proxy.policies.tenants import VirtualTokenCounter
from proxy.relay.delivered import Delivered
from proxy.request.admitted import STEPS_PAST_CUT
from proxy.server.state import ProxyState
from tests.helpers.bills import prompt_bound
from tests.helpers.clock import FakeClock
from tests.helpers.rig import tenants

TOKENS = 40  # content chunks the backend streams before it hangs or breaks
TPM = 100_000
PROMPT = "hello there"
TOKEN_BYTES = len("tok ")  # each chunk's text: a cut stream is billed its bytes (no tokenizer)
BODY = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4000}


def chunk(delta: str, index: int = 0) -> bytes:
    return (
        b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"tiny",'
        b'"choices":[{"index":%d,"delta":%s,"logprobs":null,"finish_reason":null}]}\n\n'
        % (index, delta.encode())
    )


class CutBackend:
    """Streams chat's opening chunk (its role, no token) and ``TOKENS`` one-token chunks, then
    hangs until its caller leaves (``hang``) or closes the connection (a backend that broke)."""

    def __init__(self, *, hang: bool) -> None:
        self.hang = hang
        self.sent = asyncio.Event()
        self.hung_up = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk('{"role":"assistant","content":""}'))
        for _ in range(TOKENS):
            await resp.write(chunk('{"content":"tok "}'))
        self.sent.set()
        if not self.hang:
            assert request.transport is not None
            request.transport.close()  # no usage chunk, no [DONE]: the backend broke
            return resp
        try:
            await asyncio.Event().wait()  # the engine goes on; its caller leaves
        except asyncio.CancelledError:
            self.hung_up.set()
            raise
        return resp


@dataclass
class Rig:
    state: ProxyState
    client: TestClient[web.Request, web.Application]

    def vtc(self) -> float:
        fairness = self.state.queue.fairness
        assert isinstance(fairness, VirtualTokenCounter)
        return fairness.counter("tenant-normal")

    def tpm_charged(self, clock: FakeClock) -> float:
        window = self.state.limits.windows("tenant-normal", clock())["tokens"]
        return window.limit - window.remaining

    def tokens_metric(self, kind: str) -> float:
        labels = {"tier": "normal", "kind": kind}
        return self.state.metrics.registry.get_sample_value("tierproxy_tokens_total", labels) or 0


@contextlib.asynccontextmanager
async def rig(url: str, clock: FakeClock) -> AsyncIterator[Rig]:
    """The pipeline as the app wires it, served as `tierproxy serve` serves it: a client that
    leaves cancels its handler."""
    config = make_config([{"url": url}], tenants=tenants(tokens_per_minute=TPM))
    state = ProxyState(parse_config(yaml.safe_dump(config), "test"), SECRET, clock)
    async with aiohttp.ClientSession() as session:
        state.session = session
        app = web.Application()
        app.router.add_post("/v1/chat/completions", state.pipeline.handler(BY_ENDPOINT["chat"]))
        state.dispatcher.start()
        try:
            server = TestServer(app, handler_cancellation=True)
            async with TestClient(server) as client:
                yield Rig(state, client)
        finally:
            await state.dispatcher.stop()


async def read_tokens(resp: aiohttp.ClientResponse, at_least: int) -> int:
    seen = 0
    async for line in resp.content:
        seen += line.count(b'"content":"tok "')
        if seen >= at_least:
            break
    return seen


def delivered_charge(state: ProxyState) -> tuple[float, float]:
    """(tpm tokens, fairness charge) of a stream that delivered ``TOKENS`` chunks: its prompt's
    upper bound (vLLM ran it all before the first chunk) and its text's bytes (an upper bound
    of its tokens without a tokenizer), and the engine's steps past the cut."""
    prompt = prompt_bound(state.config, {**BODY, "stream": True})
    output = TOKENS * TOKEN_BYTES + STEPS_PAST_CUT  # one sequence, its budget not reached
    return prompt + output, weighted_tokens(prompt, output)


async def test_a_client_that_leaves_after_reading_the_stream_is_billed_what_it_read(
    clock: FakeClock,
) -> None:
    # Before: the handler was cancelled, account() never ran (the fairness charge stayed at
    # the dispatch estimate), the tpm settle kept only the up-front reservation.
    backend = CutBackend(hang=True)
    async with serve_app(backend.app(), handler_cancellation=True) as url, rig(url, clock) as r:
        resp = await r.client.post(
            "/v1/chat/completions", json={**BODY, "stream": True}, headers=auth("normal")
        )
        assert await read_tokens(resp, TOKENS) == TOKENS
        resp.close()  # read everything there was, then left
        await asyncio.wait_for(backend.hung_up.wait(), 5)
        await until(lambda: r.state.limits.concurrent("tenant-normal") == 0, 5, "the settle")
        tpm, fairness = delivered_charge(r.state)
        assert r.tpm_charged(clock) == pytest.approx(tpm)
        assert r.vtc() == pytest.approx(fairness)
        assert r.tokens_metric("completion") == TOKENS * TOKEN_BYTES + STEPS_PAST_CUT


async def test_a_stream_the_backend_breaks_is_not_refunded_to_zero(clock: FakeClock) -> None:
    # Before: outcome upstream_error and no usage → correct_charge(0): the fairness charge of
    # 40 delivered tokens went back to nothing, and the tpm bucket kept the estimate.
    backend = CutBackend(hang=False)
    async with serve_app(backend.app()) as url, rig(url, clock) as r:
        resp = await r.client.post(
            "/v1/chat/completions", json={**BODY, "stream": True}, headers=auth("normal")
        )
        text = await resp.read()
        assert text.count(b'"content":"tok "') == TOKENS
        assert b"upstream_error" in text  # the relay's closing error event
        tpm, fairness = delivered_charge(r.state)
        assert r.vtc() == pytest.approx(fairness)
        assert r.tpm_charged(clock) == pytest.approx(tpm)


# -- the counter itself --------------------------------------------------------------------


def test_delivered_counts_token_chunks_not_roles_usage_or_done() -> None:
    delivered = Delivered()
    usage = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
    block = (
        chunk('{"role":"assistant","content":""}', 0)
        + chunk('{"role":"assistant","content":""}', 1)
        + chunk('{"content":"a"}', 0)
        + chunk('{"content":"b"}', 1)
        + chunk('{"content":"\\"role\\": x"}', 0)  # quoted text that names a role
        + usage
        + b"data: [DONE]\n\n"
    )
    delivered.chunks(block)
    assert delivered.events == 3
    completion = (
        b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":" x",'
        b'"logprobs":null,"finish_reason":null}]}\n\n'
    )
    delivered.chunks(completion * 2)
    assert delivered.events == 5


def test_delivered_counts_responses_delta_events_only() -> None:
    delivered = Delivered()
    events: list[dict[str, Any]] = [
        {"event": "response.created", "data": b'{"type":"response.created"}'},
        {"event": "response.output_text.delta", "data": b'{"type":"response.output_text.delta"}'},
        {"event": "response.output_text.done", "data": b'{"type":"response.output_text.done"}'},
    ]
    for event in events:
        delivered.responses_event(
            b"event: %s\ndata: %s\n\n" % (event["event"].encode(), event["data"])
        )
    assert delivered.events == 1
