"""Wiring and lifecycle: the shared state, the route table, startup and shutdown, serving.

The request path lives in ``proxy.request.pipeline``, the other routes in
``proxy.server.endpoints`` and
``proxy.server.admin``; this module only connects them.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from proxy.api.reply_headers import add_admitted_limits, add_request_id
from proxy.api.routes import ROUTES
from proxy.backends.kvwatcher import KvEventWatcher
from proxy.backends.monitor import BackendMonitor
from proxy.config.loader import ConfigError, load_config, metrics_warnings
from proxy.config.schema import LoadedConfig
from proxy.ops.reload import ConfigWatcher
from proxy.ops.runtime import run, tune_gc, tune_logging
from proxy.ops.worker_share import WorkerShare
from proxy.request.expect import expect_checker, no_continue
from proxy.server.admin import AdminEndpoints
from proxy.server.endpoints import ServiceEndpoints
from proxy.server.json_errors import json_error_bodies, json_errors
from proxy.server.listeners import Listeners
from proxy.server.open_files import raise_open_files_limit
from proxy.server.state import STATE, ProxyState
from proxy.server.upstream_session import upstream_session
from proxy.ticket import SecretError, check_secret, secret_from_env

log = logging.getLogger("tierproxy")


# Open files kept for upstream connections, probes, the config file and logs.
FD_RESERVE = 256


def create_app(
    loaded: LoadedConfig,
    *,
    secret: bytes | None = None,
    clock: Callable[[], float] = time.monotonic,
    watch_config: bool = False,
    transform: Callable[[LoadedConfig], LoadedConfig] | None = None,
) -> web.Application:
    """The proxy app; with ``watch_config``, the file in ``loaded.source`` is reloaded on SIGHUP
    and whenever it changes."""
    secret = secret if secret is not None else secret_from_env(loaded.config.ticket_secret_env)
    try:
        check_secret(secret)
    except SecretError as exc:
        raise ConfigError(
            loaded.source,
            [
                f"ticket_secret_env: environment variable {loaded.config.ticket_secret_env}"
                f" (the HMAC key shared with the vLLM plugin): {exc}"
            ],
        ) from None
    # The body limit is enforced by our own reader, which answers in the OpenAI shape; so is
    # the body's decoding (proxy.request.body), which aiohttp would otherwise do, refusing what it
    # cannot
    # decode in plain text before any handler or middleware runs.
    app = web.Application(
        client_max_size=2**62,
        middlewares=[json_errors],
        handler_args={"auto_decompress": False},
    )
    app.on_response_prepare.append(json_error_bodies)
    app.on_response_prepare.append(add_request_id)
    app.on_response_prepare.append(add_admitted_limits)
    state = ProxyState(loaded, secret, clock)
    app[STATE] = state
    if watch_config:
        state.watcher = ConfigWatcher(
            loaded.source,
            state.prepare,
            state.metrics,
            lambda: state.config,
            debounce_s=loaded.config.server.reload_debounce_s,
            transform=transform,
        )
    app.cleanup_ctx.append(_lifecycle)
    pipeline, service, admin = state.pipeline, ServiceEndpoints(state), AdminEndpoints(state)
    expect = expect_checker(pipeline)  # key and size checked before 100 Continue
    for route in ROUTES:  # every vLLM route that runs the model, through the tiers
        for path in route.paths:
            app.router.add_post(path, pipeline.handler(route), expect_handler=expect)
            app.router.add_route(  # 405 with Allow
                "*", path, service.unsupported, expect_handler=no_continue(service.unsupported)
            )
    app.router.add_get("/v1/models", service.models)
    app.router.add_get("/health", service.health)
    app.router.add_get("/version", service.version)
    app.router.add_get("/healthz", service.healthz)
    app.router.add_get("/readyz", service.readyz)
    if loaded.config.admin_listen is None:  # operators' routes here: each needs an admin key
        _add_operator_routes(app, service, admin, metrics=service.guarded_metrics)
    app.router.add_route(
        "*", "/v1/{tail:.*}", service.unsupported, expect_handler=no_continue(service.unsupported)
    )
    return app


def _add_operator_routes(
    app: web.Application,
    service: ServiceEndpoints,
    admin: AdminEndpoints,
    *,
    metrics: Callable[[web.Request], Awaitable[web.StreamResponse]] | None = None,
) -> None:
    app.router.add_get("/metrics", metrics or service.metrics)
    app.router.add_get("/admin/backends", admin.backends)
    app.router.add_get("/admin/status", admin.status)
    app.router.add_post("/admin/backends/drain", admin.drain)


def create_admin_app(public: web.Application) -> web.Application:
    """/metrics and /admin for the ``admin_listen`` listener (the public app then has neither);
    it shares the public app's state, whose lifecycle belongs to the public app."""
    state = public[STATE]
    app = web.Application()
    _add_operator_routes(app, ServiceEndpoints(state), AdminEndpoints(state))
    app.router.add_get("/healthz", ServiceEndpoints(state).healthz)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    # Before the listener opens: the first requests find the tokenizer loaded.
    await asyncio.to_thread(state.prompt_blocks.preload, state.config)
    state.session = upstream_session(state.config.backend_health)
    state.monitor = BackendMonitor(
        state.pool, state.session, state.metrics, state.dispatcher.kick, state.clock
    )
    if state.usage_log is not None:
        state.usage_log.start()
    state.dispatcher.start()
    state.monitor.start()
    state.kv_watcher = KvEventWatcher(
        state.pool, state.kv_settings, state.session, state.metrics.kv, state.clock
    )
    state.kv_watcher.start()
    if state.shared is not None:
        await state.shared.start()
    if state.watcher is not None:
        state.watcher.start()
    try:
        yield
    finally:
        if state.watcher is not None:
            await state.watcher.stop()
        await state.monitor.stop()
        await state.kv_watcher.stop()
        await state.version.stop()
        await state.dispatcher.stop()
        await state.pipeline.adapters.stop()  # before the session its loads use closes
        if state.shared is not None:
            await state.shared.stop()
        await state.session.close()
        if state.usage_log is not None:  # after the requests: their lines are all queued
            await asyncio.to_thread(state.usage_log.stop)
        if state.tracing is not None:  # after the requests: their spans are all ended
            await asyncio.to_thread(state.tracing.shutdown)


def serve(
    config_path: str,
    *,
    host: str | None = None,
    port: int | None = None,
    reuse_port: bool = False,
    share: WorkerShare | None = None,
) -> None:
    """``share``: this process is one of ``serve --workers N``; its bounds are its share."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    loaded = load_config(config_path)
    transform = share.apply if share is not None else None
    if share is not None:
        loaded = share.apply(loaded)
        log.info(
            "worker %s: max_connections %d, max_held_bytes %s, max_queue %s",
            share,
            loaded.config.server.max_connections,
            loaded.config.limits.max_held_bytes,
            {name: tier.max_queue for name, tier in loaded.config.tiers.items()},
        )
    app = create_app(loaded, watch_config=True, transform=transform)
    open_files, _ = raise_open_files_limit()
    cap = loaded.config.server.max_connections
    if loaded.config.admin_listen is not None:
        cap += loaded.config.server.admin_connections
    if cap + FD_RESERVE > open_files:
        # Past the limit accept() fails and probes and upstream connections fail with it.
        log.warning(
            "server.max_connections (+ admin_connections) %d leaves under %d of %d open files"
            " for backends and logs",
            cap,
            FD_RESERVE,
            open_files,
        )
    for warning in metrics_warnings(loaded):
        log.warning("%s", warning)
    tune_gc()
    tune_logging()
    run(_serve(app, host, port, reuse_port))  # on uvloop where installed


async def _serve(
    app: web.Application, host: str | None, port: int | None, reuse_port: bool = False
) -> None:
    """Run until SIGINT or SIGTERM: the public listener and, with ``admin_listen``, the
    operator one with connections of its own (``server:`` is read once, at start)."""
    state = app[STATE]
    cfg, listen = state.config, state.config.listen
    async with Listeners(cfg.server, on_refused=state.metrics.connections_refused.inc) as listeners:
        listeners.reuse_port = reuse_port
        state.metrics.open_connections.set_function(listeners.open_connections)
        state.metrics.connections_evicted.read = lambda: float(
            sum(gate.evicted for gate in listeners.gates)
        )
        await listeners.add(app, host or listen.host, port if port is not None else listen.port)
        if cfg.admin_listen is not None:
            admin = cfg.admin_listen
            await listeners.add(
                create_admin_app(app),
                admin.host,
                admin.port,
                reserved=cfg.server.admin_connections,
            )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping")
