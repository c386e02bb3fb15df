"""A real redis-server per test (started in ~10 ms) for the shared-state tests. Skipped where
none is installed: `make test` installs Debian's redis-server first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.bench.hostile.served import NullBackend, ServedFleet, ServedProxy, served_config
from proxy.bench.inproc import KEYS
from proxy.bench.redis_server import RedisServer
from proxy.config.tenants import hash_key
from tests.helpers.replicas import LIVE_REDIS, TENANT


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if not RedisServer.available():
        pytest.skip("redis-server is not installed (make test installs it)")
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def start(backend: NullBackend, redis_server: RedisServer, tmp_path: Path) -> Iterator[Any]:
    """``start(**tenant_limits)``: `tierproxy serve` with one tenant (the normal tier's demo key)
    and shared state in ``redis_server`` (``shared=False``: without; ``state``: more of its
    settings), in front of the test module's own ``backend`` fixture; ``others``: more tenants
    (the high tier's demo key first); all stopped at teardown."""
    fleet = ServedFleet(tmp_path)

    def run(
        shared: bool = True,
        state: dict[str, Any] | None = None,
        others: tuple[dict[str, Any], ...] = (),
        **limits: Any,
    ) -> ServedProxy:
        tenant = {"name": TENANT, "tier": "normal", "keys": [{"sha256": hash_key(KEYS["normal"])}]}
        # A busy machine must not time out a live Redis (LIVE_REDIS; a test wanting a stall
        # shorter than that sets its own).
        timeout = LIVE_REDIS["call_timeout_s"]
        settings = {"url": redis_server.url, "call_timeout_s": timeout, "probe_interval_s": 0.1}
        extra: dict[str, Any] = {"shared_state": {**settings, **(state or {})}} if shared else {}
        tenants = [{**tenant, **limits}]
        for other, key in zip(others, ("high", "low"), strict=False):
            tenants.append({"tier": key, "keys": [{"sha256": hash_key(KEYS[key])}], **other})
        config = served_config(backend.url, tenants=tenants, **extra)
        return fleet.start(config)

    with fleet:
        yield run
