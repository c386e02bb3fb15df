"""Floods against the real proxy on production's listeners: maximal bodies against the memory
budget, and idle and slowloris connections beside a real request."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import auth, make_config, running_proxy, until
from proxy.relay.budget import held_estimate
from proxy.server.state import ProxyState
from tests.helpers.answers import assert_openai_error, read_answer

MAX_BODY = 256 * 1024
ADMITTED = 6  # the budget holds this many maximal bodies
FLOOD = 40


def maximal_body() -> bytes:
    """A chat body of exactly MAX_BODY bytes."""
    frame = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": ""}]})
    content = "x" * (MAX_BODY - len(frame))
    body = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": content}]})
    assert len(body) == MAX_BODY
    return body


async def test_a_flood_of_maximal_bodies_is_refused_past_the_budget_then_all_is_released() -> None:
    body = maximal_body()
    budget = ADMITTED * held_estimate(MAX_BODY)
    backend = FakeVLLM()
    backend.gate.clear()  # the admitted requests wait at the backend, holding their bodies
    peak = 0

    async with backend.serve() as url:
        config = make_config(
            [{"url": url}], limits={"max_body_bytes": MAX_BODY, "max_held_bytes": budget}
        )
        async with (
            running_proxy(config) as (base, state),
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        ):

            async def post() -> tuple[int, dict[str, Any], str | None]:
                nonlocal peak
                headers = {**auth("low"), "Content-Type": "application/json"}
                async with session.post(
                    f"{base}/v1/chat/completions", data=body, headers=headers
                ) as resp:
                    raw = await resp.read()
                    peak = max(peak, state.budget.held)
                    error = None
                    if resp.status != 200:
                        error = assert_openai_error(resp.status, resp.content_type, raw)
                    return resp.status, error or {}, resp.headers.get("Retry-After")

            flood = [asyncio.create_task(post()) for _ in range(FLOOD)]
            try:
                # Every request past the budget is refused while the admitted ones still wait.
                await until(
                    lambda: sum(t.done() for t in flood) == FLOOD - ADMITTED,
                    30,
                    "the refusals",
                    state,
                )
                assert state.budget.held == budget and peak <= budget
                refused = [t.result() for t in flood if t.done()]
                assert {status for status, _, _ in refused} == {503}
                assert {error["code"] for _, error, _ in refused} == {"proxy_memory_full"}
                assert {retry for _, _, retry in refused} == {"1"}
            finally:
                backend.gate.set()
                answers = await asyncio.gather(*flood)
            assert sum(status == 200 for status, _, _ in answers) == ADMITTED
            await until(lambda: _nothing_held(state), 10, "every reservation released", state)
            assert peak <= budget


def _nothing_held(state: ProxyState) -> bool:
    return (
        state.budget.held == 0
        and len(state.queue) == 0
        and all(b.inflight == 0 for b in state.pool.all())
    )


async def _slowloris(port: int) -> bytes:
    """Headers a byte at a time, never finished; returns what the proxy said before it closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def trickle() -> None:
        # A byte at a time, then nothing: never the blank line. (Sending on while the proxy
        # cuts the connection turns its 408 into a reset.)
        for byte in b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nX-Slow: ":
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.02)  # the client being slow, not the test waiting

    sending = asyncio.create_task(trickle())
    said = b""
    try:
        async with asyncio.timeout(60):  # a bound against hanging, not a measurement
            while chunk := await reader.read(65536):
                said += chunk
    except ConnectionError:
        pass  # cut while it was still sending: what came before the cut is the answer
    finally:
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
        writer.close()
    return said


async def test_idle_and_slowloris_connections_are_cut_and_a_real_request_is_served() -> None:
    async with FakeVLLM().serve() as url:
        config = make_config(
            [{"url": url}],
            # Long enough that a starved test loop opens all 20 before the first is cut.
            server={"max_connections": 30, "header_timeout_s": 3.0, "keepalive_timeout_s": 6},
        )
        async with running_proxy(config) as (base, state):
            port = int(base.rsplit(":", 1)[1])
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(10)]
            slow = [asyncio.create_task(_slowloris(port)) for _ in range(10)]
            await until(lambda: _open(state) == 20, 30, "20 hostile connections open")

            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            request = orjson.dumps(
                {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            )
            key = auth("high")["Authorization"].encode()
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nAuthorization: "
                + key
                + b"\r\nContent-Length: %d\r\n\r\n" % len(request)
                + request
            )
            status, _, _ = await asyncio.wait_for(read_answer(reader), 30)
            assert status == 200
            writer.close()

            for answer in await asyncio.gather(*slow):
                head, _, body = answer.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 408 "), answer
                assert orjson.loads(body)["error"]["code"] == "header_timeout"
            for idle_reader, idle_writer in idle:  # closed by the proxy, at most a 408 said
                said = await asyncio.wait_for(idle_reader.read(), 30)
                assert said == b"" or said.startswith(b"HTTP/1.1 408 "), said
                idle_writer.close()
            await until(lambda: _open(state) == 0, 5, "every connection closed", state)


def _open(state: ProxyState) -> float:
    return state.metrics.registry.get_sample_value("tierproxy_open_connections") or 0.0
