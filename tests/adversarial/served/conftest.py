"""Fixtures: a fake backend (the one place that picks it) and served proxies in front of it,
each killed at teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.bench.hostile.served import (
    NullBackend,
    ServedFleet,
    ServedProxy,
    StartServed,
    served_config,
)


@pytest.fixture(scope="module")
def backend() -> Iterator[NullBackend]:
    """The fake backend every served proxy of a module forwards to."""
    with NullBackend() as upstream:
        yield upstream


def _starter(backend: NullBackend, fleet: ServedFleet) -> StartServed:
    def start(*, admin: bool = True, **sections: Any) -> ServedProxy:
        """A served proxy with ``sections`` (``server={...}``, ``limits={...}``) over the
        defaults; up (and on its default loop) when this returns."""
        return fleet.start(served_config(backend.url, admin=admin, **sections))

    return start


@pytest.fixture
def start_served(backend: NullBackend, tmp_path: Path) -> Iterator[StartServed]:
    """Starts served proxies with a test's own config; all stopped at teardown."""
    with ServedFleet(tmp_path) as fleet:
        yield _starter(backend, fleet)


@pytest.fixture(scope="module")
def served(backend: NullBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProxy]:
    """One served proxy with the default config, shared by a module's tests."""
    with ServedFleet(tmp_path_factory.mktemp("served")) as fleet:
        yield _starter(backend, fleet)()
