"""Fixtures: a fake backend (the one place that picks it) and served proxies in front of it,
each killed at teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.bench.hostile.served import NullBackend, ServedProxy, StartServed, served_config


@pytest.fixture(scope="module")
def backend() -> Iterator[NullBackend]:
    """The fake backend every served proxy of a module forwards to."""
    with NullBackend() as upstream:
        yield upstream


def _starter(backend: NullBackend, workdir: Path) -> tuple[StartServed, list[ServedProxy]]:
    started: list[ServedProxy] = []

    def start(*, admin: bool = True, **sections: Any) -> ServedProxy:
        """A served proxy with ``sections`` (``server={...}``, ``limits={...}``) over the
        defaults; up (and on its default loop) when this returns."""
        config = served_config(backend.url, admin=admin, **sections)
        proxy = ServedProxy(config, workdir, name=f"proxy-{len(started)}")
        started.append(proxy)
        proxy.start()
        assert proxy.on_default_loop(), "the served proxy is not on uvloop with the C parser"
        return proxy

    return start, started


@pytest.fixture
def start_served(backend: NullBackend, tmp_path: Path) -> Iterator[StartServed]:
    """Starts served proxies with a test's own config; all stopped at teardown."""
    start, started = _starter(backend, tmp_path)
    try:
        yield start
    finally:
        for proxy in started:
            proxy.stop()


@pytest.fixture(scope="module")
def served(backend: NullBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProxy]:
    """One served proxy with the default config, shared by a module's tests."""
    start, started = _starter(backend, tmp_path_factory.mktemp("served"))
    try:
        yield start()
    finally:
        for proxy in started:
            proxy.stop()
