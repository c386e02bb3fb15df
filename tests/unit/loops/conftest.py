"""Every test here runs on both event loops the proxy may run on: the standard one and uvloop
(``proxy.ops.runtime.loop_factory`` picks it where installed)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping

import pytest


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    with contextlib.suppress(ImportError):
        import uvloop

        factories["uvloop"] = uvloop.new_event_loop
    return factories
