"""The compatibility tests' ``both``: the proxy in front of ``compat_engine`` (proxy-core's
engine, as tests/integration/test_proxy_core.py's), beside that engine reached directly. A module
whose tests need another engine overrides ``compat_engine``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from proxy.tools.engine import EngineProcess
from tests.helpers.compat import Sides, engine, sides
from tests.helpers.enginefarm import EngineFarm


@pytest.fixture
def compat_engine(engines: EngineFarm) -> EngineProcess:
    return engine(engines)


@pytest.fixture
async def both(compat_engine: EngineProcess) -> AsyncIterator[Sides]:
    async with sides(compat_engine) as s:
        yield s
