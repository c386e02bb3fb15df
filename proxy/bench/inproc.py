"""The real proxy app run in-process on a free port, for benchmarks and integration tests.

The proxy answers the three tiers' demo keys (``KEYS``, ``auth(tier)``); engines that load the
plugin must share ``SECRET`` (as ``TIERPROXY_TICKET_SECRET``) to trust its tickets.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from proxy.config.loader import load_config, parse_config
from proxy.config.tenants import hash_key
from proxy.ops.process import free_port
from proxy.server.app import create_admin_app, create_app
from proxy.server.listeners import Listeners
from proxy.server.state import STATE, ProxyState

SECRET = b"integration-test-secret-of-at-least-32-bytes"
KEYS = {"high": "key-high", "normal": "key-normal", "low": "key-low"}


def make_config(
    backends: list[dict[str, Any]],
    *,
    tiers: dict[str, dict[str, Any]] | None = None,
    tenants: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    default_tiers = {
        "high": {
            "priority": 0,
            "weight": 10,
            "max_queue": 200,
            "queue_timeout_s": 60,
            "request_timeout_s": 120,
        },
        "normal": {
            "priority": 5,
            "weight": 5,
            "max_queue": 200,
            "queue_timeout_s": 60,
            "request_timeout_s": 120,
        },
        "low": {
            "priority": 10,
            "weight": 1,
            "max_queue": 500,
            "queue_timeout_s": 120,
            "request_timeout_s": 120,
        },
    }
    for name, overrides in (tiers or {}).items():
        default_tiers[name] = {**default_tiers.get(name, {}), **overrides}
    default_tenants = [
        {"name": f"tenant-{tier}", "tier": tier, "keys": [{"sha256": hash_key(key)}]}
        for tier, key in KEYS.items()
    ]
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "tiers": default_tiers,
        "tenants": tenants if tenants is not None else default_tenants,
        "backends": backends,
        **extra,
    }


@contextlib.asynccontextmanager
async def running_proxy(
    config: dict[str, Any], config_path: Path | None = None
) -> AsyncIterator[tuple[str, ProxyState]]:
    """Yields (base URL, the app's state) with the proxy serving as `tierproxy serve` does:
    on ``Listeners`` (connection cap, header and keep-alive timeouts, JSON parser errors) and,
    with ``admin_listen``, the operator listener too. With ``config_path``, the config is
    written there and watched for live reloads."""
    text = yaml.safe_dump(config)
    if config_path is not None:
        await asyncio.to_thread(config_path.write_text, text)
        loaded = load_config(config_path)
    else:
        loaded = parse_config(text, "test-config")
    app = create_app(loaded, secret=SECRET, watch_config=config_path is not None)
    state = app[STATE]
    cfg = state.config
    async with Listeners(cfg.server, on_refused=state.metrics.connections_refused.inc) as listeners:
        state.metrics.open_connections.set_function(listeners.open_connections)
        port = await listeners.add(app, "127.0.0.1", 0)
        if cfg.admin_listen is not None:
            admin = cfg.admin_listen
            await listeners.add(
                create_admin_app(app),
                admin.host,
                admin.port,
                reserved=cfg.server.admin_connections,
            )
        yield f"http://127.0.0.1:{port}", state


def auth(tier: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tier]}"}


@contextlib.asynccontextmanager
async def serve_app(
    app: web.Application, *, handler_cancellation: bool = False
) -> AsyncIterator[str]:
    """Serve ``app`` on a free loopback port (fake backends of tests and benchmarks)."""
    runner = web.AppRunner(
        app, access_log=None, shutdown_timeout=0.1, handler_cancellation=handler_cancellation
    )
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


# A wait's timeout is a bound against hanging, never a measurement: whatever a caller asks, a
# loop starved by a busy machine gets this long before the wait fails (CI failed 5 s ones).
WAIT_FLOOR_S = 30.0


async def until(
    condition: Callable[[], bool],
    timeout_s: float = 30.0,
    what: str = "",
    state: ProxyState | None = None,
) -> None:
    """Poll a condition on running servers; fail (never hang) when it does not come true,
    saying what the proxy held at that moment."""
    timeout_s = max(timeout_s, WAIT_FLOOR_S)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            held = ""
            if state is not None:
                held = f"; queue {len(state.queue)}, backends {state.pool.all()}"
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}{held}")
        await asyncio.sleep(0.01)
