"""The admin API: see the backends, drain one (in-flight work finishes) or take it back, and the
live status (``proxy.ops.live.status``) that ``tierproxy top`` shows."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from proxy.api.errors import ProxyError, bad_request, unknown_backend
from proxy.backends.backend import BackendState
from proxy.replicas.client import SharedStateDown
from proxy.request.auth import authenticate_admin
from proxy.request.inbound import BODY_READ_TIMEOUT_S

if TYPE_CHECKING:
    from proxy.server.state import ProxyState

log = logging.getLogger("tierproxy")


class AdminEndpoints:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def backends(self, request: web.Request) -> web.Response:
        try:
            authenticate_admin(request.headers, self.state.loaded)
        except ProxyError as err:
            return err.response()
        views = [self.backend_view(b) for b in self.state.pool.all()]
        return web.json_response({"backends": views})

    async def status(self, request: web.Request) -> web.Response:
        """Tiers, tenants and backends now and over the last minute; ``?tenants=N`` caps the
        tenant rows (busiest first; default 100)."""
        try:
            authenticate_admin(request.headers, self.state.loaded)
            max_tenants = _count_param(request, "tenants", 100)
        except ProxyError as err:
            return err.response()
        body = orjson.dumps(self.state.live.snapshot(max_tenants))
        return web.Response(body=body, content_type="application/json")

    async def drain(self, request: web.Request) -> web.Response:
        """``{"url": ..., "drain": true|false}``: stop new work to a backend, or take it back."""
        try:
            authenticate_admin(request.headers, self.state.loaded)
            url, drain = await _drain_request(request)
        except ProxyError as err:
            return err.response()
        backend = self.state.pool.drain(url, drain)
        if backend is None:
            return unknown_backend(url).response()
        shared = await self._share_drain(backend.cfg.url, drain)
        log.warning(
            "admin: backend %s %s%s",
            backend.label,
            "draining" if drain else "back in service",
            {None: "", True: " (every replica)", False: " (this replica only: shared state down)"}[
                shared
            ],
        )
        self.state.dispatcher.kick()
        # shared: null without shared_state; false when only this replica could apply it.
        return web.json_response({**self.backend_view(backend), "shared": shared})

    async def _share_drain(self, url: str, drain: bool) -> bool | None:
        """With shared_state, every replica (every worker too) applies the drain."""
        if self.state.shared is None:
            return None
        shared = self.state.shared.drain
        try:
            await shared.publish(url, drain)
        except SharedStateDown:
            return False
        # Answer once every replica has applied it: "draining" then means no new work anywhere.
        await asyncio.sleep(shared.settle_s)
        return True

    def backend_view(self, backend: BackendState) -> dict[str, object]:
        now = self.state.clock()
        load = backend.load
        holder = self.state.pool.token_reservations.holder(backend.cfg.url)
        return {
            "url": backend.cfg.url,
            "name": backend.label,
            "available": backend.available(now),
            "healthy": backend.healthy,
            "draining": backend.draining,
            "ejected_for_s": max(0.0, backend.ejected_until - now),
            "inflight": backend.inflight,
            "max_inflight": backend.cfg.max_inflight,
            "room": backend.max_room,
            "room_adaptive": backend.cfg.adaptive_room,
            "dispatched_total": backend.dispatched_total,
            "tokens_inflight": backend.tokens_inflight,
            "max_tokens_inflight": backend.cfg.max_tokens_inflight,
            # Draining for a request its token budget does not fit (its tier or worse wait).
            "held_for": (
                {
                    "tenant": holder.tenant,
                    "tier": holder.tier,
                    "tokens": holder.prompt_tokens + holder.expected_output,
                }
                if holder is not None
                else None
            ),
            "models": sorted(backend.models) if backend.models is not None else None,
            "vllm_waiting": load.waiting if load else None,
            "vllm_running": load.running if load else None,
            "metrics_age_s": now - load.at if load else None,
        }


def _count_param(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not 0 < int(raw) <= 100_000:
        raise bad_request(f"{name} must be a whole number from 1 to 100000")
    return int(raw)


async def _drain_request(request: web.Request) -> tuple[str, bool]:
    try:
        async with asyncio.timeout(BODY_READ_TIMEOUT_S):
            body = orjson.loads(await request.read())
        url, drain = body["url"], body.get("drain", True)
        if not isinstance(url, str) or not isinstance(drain, bool):
            raise TypeError
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise bad_request('Send {"url": "<backend url>", "drain": true|false}') from None
    return url, drain
