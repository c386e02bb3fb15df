"""Issue 22's third list, against `tierproxy serve` on its default loop (uvloop, the C parser),
with the kit's realistic clients: credentials that are not UTF-8 (#13), a gzip body of many
members (#2), uploads that announce a length and send nothing (#3). The in-process twins:
tests/unit/request/test_odd_inputs.py, tests/helpers/encoding_cases.py, test_upload_budget.py."""

from __future__ import annotations

import asyncio
import gzip
import time

import pytest

from proxy.bench.hostile.kit import RawClient, exchange, is_openai_error, request_bytes
from proxy.bench.hostile.served import ServedProxy, StartServed
from proxy.bench.inproc import KEYS
from proxy.relay.budget import held_estimate

CHAT = b'{"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
MAX_BODY = 8 * 1024 * 1024  # limits.max_body_bytes by default


def chat(headers: dict[str, str], body: bytes = CHAT) -> bytes:
    return request_bytes(
        "POST", "/v1/chat/completions", {"Content-Type": "application/json", **headers}, body
    )


# -- #13: credentials that are not UTF-8 --------------------------------------------------------

ODD_KEYS = [b"\xff\xfe\xfd", b"\xc3\x28", b"\xed\xa0\x80", b"caf\xe9"]  # not UTF-8


def raw_request(path: bytes, header: bytes, value: bytes) -> bytes:
    method = b"POST" if path == b"/v1/chat/completions" else b"GET"
    body = CHAT if method == b"POST" else b""
    return (
        method + b" " + path + b" HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        b"%s: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
        % (header, value, len(body), body)
    )


@pytest.mark.parametrize("path", [b"/v1/chat/completions", b"/v1/models"])
@pytest.mark.parametrize("header", [b"Authorization", b"api-key"])
async def test_credentials_that_are_not_utf8_get_401_not_500(
    served: ServedProxy, path: bytes, header: bytes
) -> None:
    mark = served.mark()
    for key in ODD_KEYS:
        value = b"Bearer " + key if header == b"Authorization" else key
        resp = await exchange(served.host, served.port, raw_request(path, header, value))
        assert resp.status == 401, (key, resp.status, resp.body[:300])
        assert is_openai_error(resp) and resp.error_code() == "invalid_api_key", resp.body[:300]
    assert served.count(r" ERROR ", mark) == 0, "\n".join(served.lines_since(mark))
    assert served.tracebacks(mark) == 0


# -- #2: a gzip body of many members ------------------------------------------------------------


async def test_a_gzip_body_of_many_members_is_refused_without_freezing_the_proxy(
    served: ServedProxy,
) -> None:
    """3 MiB of 20-byte empty members: each member re-copied the rest of the body, 27-47 s of
    one event loop (every tier and /healthz stalled). Now refused after a few members."""
    member = gzip.compress(b"", 9)
    data = member * (3 * 1024 * 1024 // len(member))
    headers = {"Authorization": f"Bearer {KEYS['low']}", "Content-Encoding": "gzip"}
    attacker = await RawClient.connect(served.host, served.port)
    try:
        cpu_before = served.cpu_s()
        sending = asyncio.create_task(attacker.send(chat(headers, data), 30))
        await asyncio.sleep(0.3)  # most of the body is in; the decoding starts as it ends
        started = time.monotonic()
        health = await exchange(served.host, served.port, request_bytes("GET", "/healthz"), 30)
        waited = time.monotonic() - started
        assert health.status == 200
        await sending
        resp = await attacker.read_response(30)
        cpu = served.cpu_s() - cpu_before
    finally:
        attacker.close()
    # The stall was CPU on the one event loop (27-47 s); counted in CPU seconds, which a busy
    # machine does not stretch as it does /healthz's wall-clock wait.
    assert cpu < 1.0, f"{cpu:.2f} CPU s for one request; /healthz waited {waited:.2f} s"
    assert resp.status == 400 and resp.error_code() == "invalid_content_encoding", resp.body[:300]
    assert b"members" in resp.body


# -- #3: uploads that announce a length and send nothing -----------------------------------------


async def test_announced_uploads_do_not_hold_the_memory_budget(start_served: StartServed) -> None:
    """Connections announcing limits.max_body_bytes, each sending one byte: they reserved 6 x
    the announcement up front, and two of them held this budget (a 1 GiB one: 22)."""
    proxy = start_served(limits={"max_held_bytes": 2 * held_estimate(MAX_BODY)})
    announced = {
        "Authorization": f"Bearer {KEYS['low']}",
        "Content-Type": "application/json",
        "Content-Length": str(MAX_BODY),
    }
    head = request_bytes("POST", "/v1/chat/completions", announced)
    idle = [await RawClient.connect(proxy.host, proxy.port) for _ in range(6)]
    try:
        for client in idle:
            await client.send(head + b"{")
        await asyncio.sleep(0.3)
        codes = []
        for _ in range(3):
            resp = await exchange(proxy.host, proxy.port, chat({"Authorization": _high()}))
            codes.append((resp.status, resp.error_code()))
        assert codes == [(200, None)] * 3, codes
    finally:
        for client in idle:
            client.close()


def _high() -> str:
    return f"Bearer {KEYS['high']}"
