"""Request ids: the proxy keys everything by its own (128 random bits), never by a client's
X-Request-Id, which is only echoed to that client and logged beside the proxy's."""

from __future__ import annotations

import logging
import re

import orjson
import pytest

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import KEYS, SECRET, auth, make_config
from proxy.config.tenants import hash_key
from proxy.ticket import REQUEST_ID_HEADER, TICKET_HEADER, decode_ticket
from tests.helpers.clock import FakeClock
from tests.helpers.rig import BODY, rig

OURS = re.compile(r"[0-9a-f]{32}")


@pytest.mark.parametrize("stream", [False, True])
async def test_two_tenants_with_one_client_id_get_distinct_proxy_ids(
    clock: FakeClock, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    backend = FakeVLLM()
    lines: list[bytes] = []
    async with backend.serve() as url, rig(make_config([{"url": url}]), clock) as r:
        r.state.usage.sink = lines.append  # the usage log's lines, as its writer gets them
        caplog.set_level(logging.INFO, logger="tierproxy.access")
        for tier in ("high", "normal"):
            resp = await r.client.post(
                "/v1/chat/completions",
                json={**BODY, "stream": stream},
                headers={**auth(tier), "X-Request-Id": "same-id"},
            )
            await resp.read()
            assert resp.status == 200 and resp.headers["X-Request-Id"] == "same-id"  # echoed
        resp = await r.client.post("/v1/chat/completions", json=BODY, headers=auth("low"))
        await resp.read()
        assert OURS.fullmatch(resp.headers["X-Request-Id"])  # none sent: the proxy's own
    headers = [r.headers for r in backend.received]
    sent = [h[REQUEST_ID_HEADER] for h in headers]
    tickets = [decode_ticket(h[TICKET_HEADER], SECRET) for h in headers]
    assert len(set(sent)) == 3 and all(OURS.fullmatch(rid) for rid in sent)
    assert [t.request_id for t in tickets] == sent  # the ticket binds the proxy's id
    records = [orjson.loads(line) for line in lines]
    assert [rec["request_id"] for rec in records] == sent
    assert [rec["client_request_id"] for rec in records] == ["same-id", "same-id", None]
    access = [m for m in caplog.messages if m.startswith("request_id=")]
    for rid, client in zip(sent, ("same-id", "same-id", "-"), strict=True):
        assert any(f"request_id={rid} client_request_id={client} " in m for m in access)
    # Which key served (a rotation's overlap): the start of its sha256, never the key.
    key_ids = [hash_key(KEYS[tier])[:12] for tier in ("high", "normal", "low")]
    assert [rec["key_id"] for rec in records] == key_ids
    for key_id in key_ids:
        assert sum(f" key_id={key_id} " in m for m in access) == 1
    assert not any(key in m for m in access for key in KEYS.values())


async def test_a_refused_request_echoes_the_client_id_and_logs_both(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    backend = FakeVLLM()
    async with backend.serve() as url, rig(make_config([{"url": url}]), clock) as r:
        caplog.set_level(logging.INFO, logger="tierproxy.access")
        resp = await r.client.post(
            "/v1/chat/completions", json=BODY, headers={"X-Request-Id": "mine-1"}
        )
        assert resp.status == 401 and resp.headers["X-Request-Id"] == "mine-1"
        bad = await r.client.post(
            "/v1/chat/completions", json=BODY, headers={**auth("high"), "X-Request-Id": "a b"}
        )
        assert OURS.fullmatch(bad.headers["X-Request-Id"])  # malformed: ignored
    line = next(m for m in caplog.messages if "client_request_id=mine-1" in m)
    assert OURS.fullmatch(line.split()[0].removeprefix("request_id="))
