"""The routes around generation: /v1/models, probes, /metrics, and the answer to unknown URLs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.errors import ProxyError, unknown_url
from proxy.inbound import authenticate

if TYPE_CHECKING:
    from proxy.app import ProxyState


class ServiceEndpoints:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def models(self, request: web.Request) -> web.Response:
        """The models of the available backends, for tenants only."""
        try:
            authenticate(request.headers, self.state.loaded)
        except ProxyError as err:
            return err.response()
        assert self.state.monitor is not None  # started with the app
        cards = await self.state.monitor.models_payload()
        return web.json_response(
            {"object": "list", "data": cards}, dumps=lambda o: orjson.dumps(o).decode()
        )

    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness: the process answers."""
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness: some backend takes work now."""
        ready = self.state.pool.any_available(self.state.clock())
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        if self.state.monitor is not None:
            self.state.monitor.export_gauges()
        body = generate_latest(self.state.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def unsupported(self, request: web.Request) -> web.Response:
        return unknown_url(request.method, request.path).response()
