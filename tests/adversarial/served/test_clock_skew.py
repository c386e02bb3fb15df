"""A proxy whose clock runs 10 s ahead of its engine host's, against `tierproxy serve`: the
engine side (the plugin's own ticket checks, on a clock 10 s behind) used to refuse every
ticket as "issued in the future" (requests ran at the lowest priority, logged at DEBUG). The
proxy now reads each backend's clock from its Date header and stamps ``issued_at`` on it."""

from __future__ import annotations

import asyncio
import email.utils
import time
from collections.abc import Awaitable, Callable, Iterator

import aiohttp
import pytest
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import exchange, json_request
from proxy.bench.hostile.served import (
    ADMIN_KEY,
    ServedProxy,
    StartServed,
    ThreadedUpstream,
    auth_header,
)
from proxy.bench.inproc import SECRET
from proxy.ticket import REQUEST_ID_HEADER, TICKET_HEADER
from proxy.vllm_plugin.settings import DEFAULT_TICKET_MAX_SKEW_S, DEFAULT_TICKET_WINDOW_S
from proxy.vllm_plugin.verify import body_matches, check_binding, check_ticket

SKEW_S = -10.0  # the engine host's clock minus the proxy's


def engine_now() -> float:
    return time.time() + SKEW_S


def skewed_engine() -> web.Application:
    """The null backend on a host whose clock is ``SKEW_S`` off: its Date headers say so, and
    it trusts a request only as the plugin's middleware would (same checks, its clock)."""
    app = FakeVLLM(model="null", usage=(4, 4)).app()

    async def date(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["Date"] = email.utils.formatdate(engine_now(), usegmt=True)

    @web.middleware
    async def plugin_checks(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.method != "POST":
            return await handler(request)
        tickets = [v.encode() for v in request.headers.getall(TICKET_HEADER, [])]
        ids = [v.encode() for v in request.headers.getall(REQUEST_ID_HEADER, [])]
        ticket, problem = check_ticket(tickets, SECRET)
        if ticket is not None:
            problem = check_binding(
                ticket,
                ids,
                now=engine_now(),
                window_s=DEFAULT_TICKET_WINDOW_S,
                max_skew_s=DEFAULT_TICKET_MAX_SKEW_S,
            )
        if (
            problem is None
            and ticket is not None
            and not body_matches(ticket, await request.read())
        ):
            problem = "ticket is for another body"
        if problem is not None:
            error = {
                "message": problem,
                "type": "PermissionDeniedError",
                "param": None,
                "code": 403,
            }
            return web.json_response({"error": error}, status=403)
        return await handler(request)

    app.middlewares.append(plugin_checks)
    app.on_response_prepare.append(date)
    return app


@pytest.fixture(scope="module")
def backend() -> Iterator[ThreadedUpstream]:
    with ThreadedUpstream(skewed_engine()) as upstream:
        yield upstream


async def clock_offset(proxy: ServedProxy) -> float | None:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"{proxy.admin_url}/metrics", headers=headers, timeout=aiohttp.ClientTimeout(5)
        ) as resp,
    ):
        for line in (await resp.text()).splitlines():
            if line.startswith("tierproxy_backend_clock_offset_seconds{"):
                return float(line.rsplit(" ", 1)[1])
    return None


async def test_tickets_are_stamped_on_the_engine_hosts_clock(start_served: StartServed) -> None:
    proxy = start_served()
    body = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    request = json_request(
        "/v1/chat/completions", body, None, {"Authorization": auth_header("high")}
    )
    statuses = []
    for _ in range(60):  # from the monitor's first /metrics probe (at start) on
        resp = await exchange(proxy.host, proxy.port, request)
        statuses.append(resp.status)
        if resp.status == 200:
            break
        await asyncio.sleep(0.05)
    # The engine's checks trust the ticket (every one was 403 "ticket issued in the future").
    assert resp.status == 200, (statuses[-3:], resp.body)
    for _ in range(3):
        assert (await exchange(proxy.host, proxy.port, request)).status == 200
    offset = await clock_offset(proxy)
    assert offset is not None and abs(offset - SKEW_S) < 1.5, offset
    assert proxy.count(r"clock is (9|10)\.\d s behind this host.s") == 1  # once, not per probe
