"""A stream read to ``data: [DONE]`` is ``ok`` on `tierproxy serve` (uvloop, the C parser) when
the backend's end of body comes well after it: clients on raw sockets read to ``[DONE]`` and
close (the OpenAI SDK's way), and the access log, ``tierproxy_requests_total`` and goodput
(``tierproxy_slo_requests_total``) say ``ok``. The in-process twin:
tests/adversarial/test_stream_end.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import RawClient, exchange, json_request, request_bytes
from proxy.bench.hostile.served import (
    ADMIN_KEY,
    NullBackend,
    ServedProxy,
    served_config,
)
from proxy.bench.inproc import KEYS
from proxy.telemetry.prometheus import of

LATE_S = 0.3
STREAMS = 6
SLO = {"ttft_s": 30.0, "itl_s": 30.0, "percentile": 99}
BODY = {
    "model": "null",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
    "stream": True,
}


@pytest.fixture
def late_proxy(tmp_path: Path) -> Iterator[ServedProxy]:
    backend = NullBackend(FakeVLLM(model="null", usage=(4, 4), end_delay_s=LATE_S)).start()
    try:
        config = served_config(backend.url)
        config["tiers"]["normal"]["slo"] = SLO
        with ServedProxy(config, tmp_path).start() as proxy:
            assert proxy.on_default_loop()
            yield proxy
    finally:
        backend.stop()


async def read_to_done_and_close(proxy: ServedProxy) -> None:
    client = await RawClient.connect(proxy.host, proxy.port)
    try:
        await client.send(json_request("/v1/chat/completions", BODY, KEYS["normal"]))
        assert await client.read_until(b"data: [DONE]", 1) == 1
    finally:
        client.close()


async def metric(proxy: ServedProxy, name: str, **labels: str) -> float:
    head = {"Authorization": f"Bearer {ADMIN_KEY}"}
    port = proxy.admin_port or proxy.port
    resp = await exchange(proxy.host, port, request_bytes("GET", "/metrics", head))
    assert resp.status == 200
    return sum(
        s.value
        for s in of(resp.body.decode(), name)
        if all(s.labels.get(k) == v for k, v in labels.items())
    )


async def test_served_streams_read_to_done_are_ok_when_the_backend_ends_late(
    late_proxy: ServedProxy,
) -> None:
    mark = late_proxy.mark()
    await asyncio.gather(*(read_to_done_and_close(late_proxy) for _ in range(STREAMS)))
    deadline = asyncio.get_running_loop().time() + 10
    while late_proxy.count(r"tierproxy.access.*tier=normal", mark) < STREAMS:
        assert asyncio.get_running_loop().time() < deadline, late_proxy.lines_since(mark)
        await asyncio.sleep(0.05)
    await asyncio.sleep(LATE_S * 2)  # the backends' late ends have come and gone
    lines = [ln for ln in late_proxy.lines_since(mark) if "tierproxy.access" in ln]
    assert len(lines) == STREAMS
    assert all("status=200 outcome=ok" in ln for ln in lines), lines
    total = "tierproxy_requests_total"
    assert await metric(late_proxy, total, tier="normal", outcome="ok") == STREAMS
    assert await metric(late_proxy, total, tier="normal", outcome="client_gone") == 0
    goodput = {"tier": "normal", "tenant": "tenant-normal"}
    assert await metric(late_proxy, "tierproxy_slo_requests_total", **goodput) == STREAMS
    assert await metric(late_proxy, "tierproxy_slo_met_total", **goodput) == STREAMS
