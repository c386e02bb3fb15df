"""A real redis-server per test (started in ~10 ms) for the shared-state tests. Skipped where
none is installed: `make test` installs Debian's redis-server first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_server import RedisServer


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
