"""Stored responses (proxy.request.stored, docs/routes.md): the proxy refuses what needs one and
sends every other Responses request with ``store: false``; the stored-response routes are not
served."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import auth
from tests.helpers.clock import FakeClock
from tests.helpers.routes_app import BODIES, proxy

BODY = BODIES["/v1/responses"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "background"),
        ({"background": "true", "store": True}, "background"),  # read as vLLM reads it
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_0123"}, "previous_response_id"),
    ],
)
async def test_what_needs_a_stored_response_is_refused(
    clock: FakeClock, extra: dict[str, Any], param: str
) -> None:
    backend = FakeVLLM()
    body = {**BODY, **extra}
    async with (
        proxy(clock, backend) as (client, _),
        client.post("/v1/responses", json=body, headers=auth("high")) as r,
    ):
        assert r.status == 400 and r.headers["x-should-retry"] == "false"
        error = (await r.json())["error"]
    assert error["param"] == param and error["code"] == "unsupported_parameter"
    assert "stores no responses" in error["message"]
    assert backend.received == []  # never reached a backend


@pytest.mark.parametrize("extra", [{}, {"store": False}, {"background": False, "store": None}])
async def test_every_other_request_is_sent_with_store_false(
    clock: FakeClock, extra: dict[str, Any]
) -> None:
    backend = FakeVLLM()
    body = {**BODY, **extra}
    async with (
        proxy(clock, backend) as (client, _),
        client.post("/v1/responses", json=body, headers=auth("high")) as r,
    ):
        assert r.status == 200, await r.text()
    assert backend.received[0].body["store"] is False  # OpenAI's default would be true


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/responses/resp_0123"),
        ("POST", "/v1/responses/resp_0123/cancel"),
        ("GET", "/v1/responses/resp_0123/input_items"),
        ("DELETE", "/v1/responses/resp_0123"),
    ],
)
async def test_stored_response_routes_are_not_served(
    clock: FakeClock, method: str, path: str
) -> None:
    backend = FakeVLLM()
    async with (
        proxy(clock, backend) as (client, _),
        client.request(method, path, headers=auth("high")) as r,
    ):
        assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_url"
    assert backend.received == []
