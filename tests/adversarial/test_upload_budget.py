"""Uploads in progress are reserved in the memory budget as their bytes arrive (issue 22), with a
Content-Length or chunked alike: what a Content-Length announces costs nothing until it comes
(idle connections announcing 8 MiB each once held the whole budget, issue 22 #3). Concurrent
large uploads cannot pass ``limits.max_held_bytes``. In process, over the pipeline rig; the
served twins are in tests/adversarial/served/test_memory_routes_startup_served.py and test_odd_inputs_served.py."""

from __future__ import annotations

import asyncio

import orjson

from proxy.bench.hostile.kit import RawClient
from proxy.bench.inproc import KEYS, until
from proxy.relay.budget import held_estimate
from tests.helpers.clock import FakeClock
from tests.helpers.rig import BODY, relay_config, rig

UPLOAD = 1_000_000  # bytes of body announced


def upload_head(length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
        f"Authorization: Bearer {KEYS['normal']}\r\nContent-Type: application/json\r\n"
        f"{framing}\r\n\r\n"
    ).encode()


def padded_body(size: int) -> bytes:
    """A valid chat body of about ``size`` bytes."""
    body = orjson.dumps({**BODY, "messages": [{"role": "user", "content": "x"}]})
    content = "x" * (size - len(body))
    return orjson.dumps({**BODY, "messages": [{"role": "user", "content": content}]})


async def test_an_upload_with_its_length_is_reserved_as_its_bytes_arrive(
    clock: FakeClock,
) -> None:
    async with rig(relay_config("http://127.0.0.1:9"), clock) as r:
        client = await RawClient.connect(str(r.client.host), r.client.port or 0)
        try:
            start = b'{"model":'
            await client.send(upload_head(UPLOAD) + start)
            await until(lambda: r.state.budget.held > 0, 3, "the upload's first bytes reserved")
            assert r.state.budget.held == held_estimate(len(start))  # not what was announced
            piece = b"x" * 200_000
            await client.send(piece)
            grown = held_estimate(len(start) + len(piece))
            await until(lambda: r.state.budget.held == grown, 3, "the reservation grown")
        finally:
            client.close()
        await until(lambda: r.state.budget.held == 0, 3, "the reservation released")


async def test_a_chunked_upload_is_reserved_as_it_arrives(clock: FakeClock) -> None:
    async with rig(relay_config("http://127.0.0.1:9"), clock) as r:
        client = await RawClient.connect(str(r.client.host), r.client.port or 0)
        try:
            piece = b"x" * 200_000
            await client.send(upload_head(None) + b"%x\r\n%s\r\n" % (len(piece), piece))
            await until(lambda: r.state.budget.held >= held_estimate(len(piece)), 3, "reserved")
        finally:
            client.close()
        await until(lambda: r.state.budget.held == 0, 3, "the reservation released")


async def test_concurrent_uploads_cannot_pass_the_budget(clock: FakeClock) -> None:
    config = relay_config("http://127.0.0.1:9")
    config["limits"] = {"max_held_bytes": held_estimate(UPLOAD) + 1000}
    async with rig(config, clock) as r:
        first = await RawClient.connect(str(r.client.host), r.client.port or 0)
        second = await RawClient.connect(str(r.client.host), r.client.port or 0)
        try:
            sent = UPLOAD - 1000  # all but the end: most of the budget, held while it waits
            await first.send(upload_head(UPLOAD) + b"x" * sent)
            await until(
                lambda: r.state.budget.held == held_estimate(sent), 3, "the first upload's bytes"
            )
            body = padded_body(UPLOAD)
            await second.send(upload_head(len(body)) + body)
            answer = await second.read_response()
            assert answer.status == 503 and answer.error_code() == "proxy_memory_full"
            assert r.state.budget.held == held_estimate(sent)
            assert r.state.budget.held <= config["limits"]["max_held_bytes"]
        finally:
            first.close()
            second.close()
        await asyncio.sleep(0)


async def test_announced_uploads_hold_nothing_until_they_send(clock: FakeClock) -> None:
    """Eight connections announce a whole budget's worth each and send one byte: a request that
    fits is served meanwhile (it got 503 proxy_memory_full when announcements were reserved)."""
    config = relay_config("http://127.0.0.1:9")
    config["limits"] = {"max_held_bytes": held_estimate(UPLOAD) + 1000}
    async with rig(config, clock) as r:
        idle = [await RawClient.connect(str(r.client.host), r.client.port or 0) for _ in range(8)]
        try:
            for client in idle:
                await client.send(upload_head(UPLOAD) + b"{")
            await until(lambda: r.state.budget.held == 8 * held_estimate(1), 3, "one byte each")
            # Not JSON: read whole and reserved, then refused 400 without a backend call.
            body = b"x" * (UPLOAD // 2)
            other = await RawClient.connect(str(r.client.host), r.client.port or 0)
            try:
                await other.send(upload_head(len(body)) + body)
                answer = await other.read_response()
            finally:
                other.close()
            assert answer.status == 400, answer.body[:300]
        finally:
            for client in idle:
                client.close()
        await until(lambda: r.state.budget.held == 0, 3, "the reservations released")
