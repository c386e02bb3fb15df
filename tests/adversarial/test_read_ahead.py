"""A client that reads slower than its backend writes lags within the relay's read-ahead
(``relay.read_ahead_bytes``): once the backend's answer is read whole, the backend's slot and
tokens are handed on while the rest drains to the client. Through the real pipeline (the rig of
tests/helpers/rig.py) against the fake vLLM, for what a real engine cannot show: a backend that
breaks once its room was handed on, a client that leaves mid-drain. The served twin, on a real
engine: tests/integration/test_token_drain_served.py."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM, Script
from proxy.bench.hostile.kit import RawClient, json_request
from proxy.bench.inproc import KEYS, until
from tests.adversarial.test_stream_done import COMPLETION, DONE, choice, usage
from tests.helpers.clock import FakeClock
from tests.helpers.rig import BODY, Rig, relay_config, rig
from tests.helpers.sse_answers import chunk

# ~200 KB of events: past what a non-reader's connection held before (asyncio's 64 KiB and
# ~50 KB in the kernel, kit.realistic_socket) and within the default read-ahead (256 KiB).
EVENTS = 180
TEXT = "z" * 1_000
WRITTEN = 128 * 1024  # a body past this went beyond what the connection held without it


def answer(*, ends: bool) -> Script:
    """The events, then vLLM's end (usage, [DONE]) or, once all was read, a dropped connection."""

    async def script(request: web.Request, n: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(EVENTS):
            await resp.write(chunk(TEXT))
        if ends:
            await resp.write(choice(0, "stop") + usage(EVENTS) + DONE)
            await resp.write_eof()
            return resp
        transport = request.transport
        assert transport is not None
        await until(lambda: transport.get_write_buffer_size() == 0, 30, "the proxy to read all")
        transport.abort()
        return resp

    return script


@contextlib.asynccontextmanager
async def stalled(ends: bool, clock: FakeClock) -> AsyncIterator[tuple[Rig, RawClient]]:
    """A stream whose client sent its request and reads nothing until the test says so; only
    the end of the backend's answer can free its slot (the send-idle bound is 120 s)."""
    backend = FakeVLLM(script=answer(ends=ends))
    config = relay_config("", send_idle_timeout_s=120)
    async with backend.serve() as url:
        config["backends"] = [{"url": url}]
        async with rig(config, clock) as r:
            assert r.client.port is not None
            client = await RawClient.connect(str(r.client.host), r.client.port)
            try:
                body = {**BODY, "stream": True}
                await client.send(json_request("/v1/chat/completions", body, KEYS["normal"]))
                await until(lambda: len(backend.received) == 1, 30, "the request at the backend")
                # Handed on at the backend's end, while its client has read none of it.
                await until(lambda: r.backend().inflight == 0, 30, "the slot to be freed")
                assert r.backend().tokens_inflight == 0
                yield r, client
            finally:
                client.sock.close()


async def test_a_stalled_stream_within_the_read_ahead_frees_its_backend_at_its_end(
    clock: FakeClock,
) -> None:
    async with stalled(True, clock) as (r, client):
        assert r.requests_total("ok") == 0  # still draining to its client
        resp = await client.read_response(30)
        assert resp.status == 200 and resp.body.endswith(DONE) and len(resp.body) > WRITTEN
        assert resp.body.count(b'"content":"z') == EVENTS
        await until(lambda: r.requests_total("ok") == 1, 30, "the outcome")
        assert r.metric("tierproxy_tokens_total", COMPLETION) == EVENTS  # vLLM's usage


async def test_a_backend_that_breaks_after_its_room_was_handed_on_ends_with_an_error_event(
    clock: FakeClock,
) -> None:
    async with stalled(False, clock) as (r, client):
        resp = await client.read_response(30)
        assert resp.status == 200 and resp.body.count(b'"content":"z') == EVENTS
        # Not a hang, not a silent cut: the error event, then [DONE].
        assert resp.body.endswith(DONE) and b'"code":"upstream_error"' in resp.body
        await until(lambda: r.requests_total("upstream_error") == 1, 30, "the outcome")
        assert r.backend().failures == 1 and r.backend().inflight == 0
        # No usage came: billed what it delivered, never less than the engine made.
        assert r.metric("tierproxy_tokens_total", COMPLETION) >= EVENTS


async def test_a_client_that_leaves_mid_drain_is_billed_what_the_engine_made(
    clock: FakeClock,
) -> None:
    async with stalled(True, clock) as (r, client):
        client.sock.close()  # unread bytes: a reset
        await until(lambda: r.requests_total("client_gone") == 1, 30, "the outcome")
        assert r.metric("tierproxy_tokens_total", COMPLETION) >= EVENTS
        assert r.state.pipeline.budget.held == 0  # the read-ahead's bytes given back
