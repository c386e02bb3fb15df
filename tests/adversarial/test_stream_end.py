"""A stream whose last event reached the client is ``ok``, whatever comes after it: vLLM's end
of body comes apart from ``data: [DONE]`` (and from a Responses stream's final event), and a
client that reads to the last event and closes must not be counted ``client_gone`` (it fell out
of goodput and of the adaptive room's SLO signal). The fake backend ends its body well after
its last event; the proxy runs as `tierproxy serve` runs it (handler cancellation on). The
served twin: tests/adversarial/served/test_stream_end_served.py."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import auth, make_config, running_proxy, until
from proxy.server.state import ProxyState

LATE_S = 0.3  # from the last event to the end of the backend's body
STREAMS = 4
SLO = {"ttft_s": 30.0, "itl_s": 30.0, "percentile": 99}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
    "stream": True,
}
RESPONSES = {"model": "tiny", "input": "hi", "stream": True}


async def read_to_last_event_and_close(
    session: aiohttp.ClientSession, url: str, path: str, body: dict[str, object], last: bytes
) -> None:
    """Read the stream up to its last event, then close the connection without waiting for
    the body's end (what the OpenAI SDK does at ``[DONE]``)."""
    async with session.post(url + path, json=body, headers=auth("normal")) as resp:
        assert resp.status == 200
        async with asyncio.timeout(10):
            seen = b""
            while last not in seen:
                line = await resp.content.readline()
                assert line, f"the stream ended before {last!r}: {seen[-300:]!r}"
                seen += line
        resp.close()  # the connection goes, whatever the proxy still had to send


def sample(state: ProxyState, name: str, **labels: str) -> float:
    return state.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize(
    ("path", "body", "last"),
    [
        ("/v1/chat/completions", CHAT, b"data: [DONE]"),
        ("/v1/responses", RESPONSES, b"event: response.completed"),
    ],
    ids=["chat", "responses"],
)
async def test_a_stream_read_to_its_last_event_is_ok_when_the_backend_ends_late(
    path: str, body: dict[str, object], last: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tierproxy.access")
    fake = FakeVLLM(end_delay_s=LATE_S)
    async with fake.serve() as upstream:
        config = make_config([{"url": upstream}], tiers={"normal": {"slo": SLO}})
        async with running_proxy(config) as (url, state), aiohttp.ClientSession() as session:
            for _ in range(STREAMS):
                await read_to_last_event_and_close(session, url, path, body, last)

            def finished() -> float:
                return sum(
                    sample(state, "tierproxy_requests_total", tier="normal", outcome=o)
                    for o in ("ok", "client_gone")
                )

            await until(lambda: finished() >= STREAMS, 10, "the streams to be logged")
            await asyncio.sleep(LATE_S * 2)  # nothing is re-counted once the backend ends
            outcomes = {
                o: sample(state, "tierproxy_requests_total", tier="normal", outcome=o)
                for o in ("ok", "client_gone")
            }
            assert outcomes == {"ok": STREAMS, "client_gone": 0}
            # Goodput counts them, and they met the (generous) target.
            goodput = {"tier": "normal", "tenant": "tenant-normal"}
            assert sample(state, "tierproxy_slo_requests_total", **goodput) == STREAMS
            assert sample(state, "tierproxy_slo_met_total", **goodput) == STREAMS
            # Billed by vLLM's usage (7 prompt, 3 completion), not by what was delivered.
            assert sample(state, "tierproxy_tokens_total", tier="normal", kind="prompt") == (
                7 * STREAMS
            )
    lines = [r.getMessage() for r in caplog.records if r.name == "tierproxy.access"]
    assert len(lines) == STREAMS
    assert all("status=200 outcome=ok" in line for line in lines), lines
