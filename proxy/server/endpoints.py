"""The routes around the model routes: /v1/models, probes (the proxy's /healthz and /readyz,
vLLM's /health and /version), /metrics, and the answer to unknown URLs and wrong methods."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.api.errors import (
    ProxyError,
    method_not_allowed,
    metrics_private,
    no_backend,
    unknown_url,
)
from proxy.api.routes import POST_PATHS
from proxy.config.adapters import adapter_cards, model_visible
from proxy.config.tenants import allowed_models
from proxy.request.auth import authenticate, authenticate_admin

if TYPE_CHECKING:
    from proxy.server.state import ProxyState


class ServiceEndpoints:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def models(self, request: web.Request) -> web.Response:
        """The models of the available backends that the tenant may use, for tenants only."""
        loaded = self.state.loaded
        try:
            tenant = authenticate(request.headers, loaded)
        except ProxyError as err:
            return err.response()
        assert self.state.monitor is not None  # started with the app
        # Only what the key may use (the tenant's `models`, else its tier's).
        patterns = allowed_models(tenant, loaded.config.tiers[tenant.tier])
        adapters = loaded.config.adapters
        engine_cards = await self.state.monitor.models_payload()
        # The served models; adapters (cards with a parent) only as the catalogue says, in
        # the proxy's own cards, loaded or not (the proxy loads one on first use).
        cards = [
            card
            for card in engine_cards
            if card.get("parent") is None
            and model_visible(str(card.get("id", "")), patterns, adapters, tenant)
        ]
        served = {str(c.get("id", "")) for c in engine_cards if c.get("parent") is None}
        cards += adapter_cards(adapters, tenant, patterns, lambda base: base in served)
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

    async def guarded_metrics(self, request: web.Request) -> web.Response:
        """/metrics on the client listener (no ``admin_listen``): it names every tenant and its
        usage, so only an admin key reads it (Prometheus sends it as a bearer token); 404 while
        no admin key is configured, 401 without one."""
        if not self.state.loaded.admin_key_hashes:
            return metrics_private().response()
        try:
            authenticate_admin(request.headers, self.state.loaded)
        except ProxyError as err:
            return err.response()
        return await self.metrics(request)

    async def metrics(self, request: web.Request) -> web.Response:
        """/metrics on the ``admin_listen`` listener: open, as that listener is the operators'."""
        if self.state.monitor is not None:
            self.state.monitor.export_gauges()
        body = generate_latest(self.state.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        """vLLM's /health (GuideLLM's start-up check): 200 and no body while some backend takes
        work, else 503. Unauthenticated, as in vLLM."""
        if self.state.pool.any_available(self.state.clock()):
            return web.Response(status=200)
        return no_backend("No backend is available.").response()

    async def version(self, request: web.Request) -> web.Response:
        """vLLM's /version, as an available backend answers it (unauthenticated, as in vLLM),
        from a cache (``proxy.server.version``): never a backend call per request."""
        version = await self.state.version.get()
        if version is None:
            return no_backend("No backend answered its version.").response()
        return web.json_response({"version": version})

    async def unsupported(self, request: web.Request) -> web.Response:
        if request.path in POST_PATHS:  # a route we serve, another method
            resp = method_not_allowed(request.method, request.path, "POST").response()
            resp.headers["Allow"] = "POST"
            return resp
        return unknown_url(request.method, request.path).response()
