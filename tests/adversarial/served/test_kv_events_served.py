"""A hostile backend against the KV-cache path of `tierproxy serve` (fresh eyes k01, k02, t01):
its KV events (a ZMQ publisher in the test, vLLM's wire format) carry events of no vLLM shape
and a sequence number jumping by 2**62, and its /tokenize answers a token id of 2**63. The
subscriber goes on (the batches after are counted) and clients get their answers. The
in-process twins: tests/unit/backends/test_kvsubscriber.py, test_kvindex.py and
tests/unit/request/test_remote_tokens.py."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import exchange, json_request, request_bytes
from proxy.bench.hostile.served import ADMIN_KEY, NullBackend, ServedProxy
from proxy.bench.inproc import KEYS
from proxy.ops.process import free_port

PORT = free_port()


@pytest.fixture(scope="module")
def backend() -> Iterator[NullBackend]:
    """FakeVLLM with vLLM's /kv_event_sources (a wildcard host, as vLLM binds) and a /tokenize
    that answers an id past 64 bits."""
    upstream = NullBackend(FakeVLLM())

    async def sources(request: web.Request) -> web.Response:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{PORT}"}
        return web.json_response({"0": config})

    async def tokenize(request: web.Request) -> web.Response:
        return web.json_response({"tokens": [2**63, 1, 2, 3, 4]})

    upstream.app.router.add_get("/kv_event_sources", sources)
    upstream.app.router.add_post("/tokenize", tokenize)
    with upstream:
        yield upstream


def _batch(seq: int, *events: dict[str, Any]) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), list(events), 0])]


def _stored(hashes: list[Any], ids: list[int]) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "token_ids": ids, "block_size": 4}


async def _events_counted(proxy: ServedProxy) -> float:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    port = proxy.admin_port or proxy.port
    resp = await exchange(proxy.host, port, request_bytes("GET", "/metrics", admin))
    text = resp.body.decode()
    return sum(float(v) for v in re.findall(r"^tierproxy_kv_events_total\{.*\} (\S+)$", text, re.M))


async def test_a_hostile_backend_leaves_the_kv_path_working(start_served: Any) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{PORT}")
    try:
        proxy = start_served(kv_cache={"enabled": True, "block_size": 4})
        assert pub.poll(20_000), "the proxy never subscribed"
        assert pub.recv()[:1] == b"\x01"
        pub.send_multipart(_batch(0, _stored([1], [1, 2, 3, 4])))
        # An unhashable hash and a token id past 64 bits: each once killed the subscriber.
        poison = [
            {"type": "BlockRemoved", "block_hashes": [[1]]},
            _stored([2], [2**63, 1, 2, 3]),
        ]
        pub.send_multipart(_batch(1, *poison))
        pub.send_multipart(_batch(2**62, _stored([3], [5, 6, 7, 8])))  # once: list(range(...))
        pub.send_multipart(_batch(2**62 + 1, {"type": "AllBlocksCleared"}))
        deadline = time.monotonic() + 10
        while await _events_counted(proxy) < 3:
            assert time.monotonic() < deadline, "the batches after the poison were not applied"
            await asyncio.sleep(0.1)
        # The /tokenize answer's id past 64 bits: no blocks, the request goes on (it was a 500).
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(3):
            resp = await exchange(
                proxy.host, proxy.port, json_request("/v1/chat/completions", body, KEYS["normal"])
            )
            assert resp.status == 200, resp.body[:300]
        assert proxy.count(r"Traceback|unhandled") == 0
    finally:
        pub.close(linger=0)
        ctx.destroy(linger=0)
