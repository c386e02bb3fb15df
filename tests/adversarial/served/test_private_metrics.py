"""/metrics on `tierproxy serve`'s client listener (no admin_listen): it names every tenant and
its usage, so a client without the admin key gets 401 and no tenant name (docs/isolation.md)."""

from __future__ import annotations

from proxy.bench.hostile.kit import exchange, json_request, request_bytes
from proxy.bench.hostile.served import ADMIN_KEY, StartServed, auth_header
from proxy.config.tenants import hash_key

BODY = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


async def test_metrics_on_the_client_listener_needs_the_admin_key(
    start_served: StartServed,
) -> None:
    proxy = start_served(admin=False, admin_keys=[{"sha256": hash_key(ADMIN_KEY)}])
    chat = json_request("/v1/chat/completions", BODY, None, {"Authorization": auth_header("high")})
    assert (await exchange(proxy.host, proxy.port, chat)).status == 200
    for headers in ({}, {"Authorization": auth_header("high")}, {"Authorization": "Bearer x"}):
        resp = await exchange(proxy.host, proxy.port, request_bytes("GET", "/metrics", headers))
        assert resp.status == 401, headers
        assert b"tenant" not in resp.body and b"tierproxy_" not in resp.body
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    resp = await exchange(proxy.host, proxy.port, request_bytes("GET", "/metrics", admin))
    assert resp.status == 200 and b'tenant="tenant-high"' in resp.body
