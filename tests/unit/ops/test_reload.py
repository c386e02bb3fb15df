"""Live reload (proxy.ops.reload): debounced, parsed off the event loop, restart-only changes logged."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from proxy.config.loader import load_config
from proxy.config.schema import Config, LoadedConfig
from proxy.config.tenants import hash_key
from proxy.ops.reload import LIVE_SECTIONS, RESTART_FIELDS, ConfigWatcher
from proxy.telemetry.metrics import ProxyMetrics


def config_text(tenants: int, port: int = 8000) -> str:
    """Backends before tenants: any prefix cut between tenants is itself a valid config, the
    half-written file that must never be applied."""
    head = {
        "listen": {"host": "127.0.0.1", "port": port},
        "tiers": {
            "high": {
                "priority": 0,
                "weight": 1,
                "max_queue": 10,
                "queue_timeout_s": 1,
                "request_timeout_s": 1,
            },
        },
        "backends": [{"url": "http://127.0.0.1:8100"}],
    }
    body = [
        {"name": f"t{i}", "tier": "high", "keys": [{"sha256": hash_key(f"k{i}")}]}
        for i in range(tenants)
    ]
    return yaml.safe_dump(head, sort_keys=False) + yaml.safe_dump({"tenants": body})


class Sleeps:
    """The watcher's injected sleep: returns at once, running a hook during the debounce."""

    def __init__(self) -> None:
        self.during_debounce: Callable[[], object] | None = None
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
        if self.during_debounce is not None:
            hook, self.during_debounce = self.during_debounce, None
            hook()


class Applied:
    def __init__(self, initial: LoadedConfig) -> None:
        self.current = initial
        self.calls: list[LoadedConfig] = []

    def __call__(self, loaded: LoadedConfig) -> Callable[[], LoadedConfig]:
        def commit() -> LoadedConfig:
            old, self.current = self.current, loaded
            self.calls.append(loaded)
            return old

        return commit

    def config(self) -> Config:
        return self.current.config


def watcher(path: Path, sleeps: Sleeps | None = None) -> tuple[ConfigWatcher, Applied]:
    applied = Applied(load_config(path))
    watch = ConfigWatcher(
        path, applied, ProxyMetrics(), applied.config, debounce_s=0.2, sleep=sleeps or Sleeps()
    )
    return watch, applied


async def test_a_file_written_in_two_pieces_is_applied_once_whole(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(config_text(2))
    sleeps = Sleeps()
    watch, applied = watcher(path, sleeps)
    full = config_text(40)
    half = full[: full.index("- keys", len(full) // 2)]  # cut between two tenants
    path.write_text(half)
    assert len(load_config(path).config.tenants) < 40  # the half file alone would validate

    sleeps.during_debounce = lambda: path.write_text(full)  # the rest lands meanwhile
    assert not await watch.check()
    assert applied.calls == [] and sleeps.calls == [0.2]
    assert await watch.check()  # stable now: read twice, the same
    assert [len(c.config.tenants) for c in applied.calls] == [40]
    assert not await watch.check()  # nothing changed since
    assert len(applied.calls) == 1


async def test_a_broken_file_changes_nothing_and_counts_an_error(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(config_text(2))
    watch, applied = watcher(path)
    path.write_text(config_text(2).replace("weight: 1", "weight: -1"))
    assert not await watch.check()
    assert applied.calls == []
    errors = watch.metrics.registry.get_sample_value(
        "tierproxy_config_reloads_total", {"result": "error"}
    )
    assert errors == 1


async def test_parsing_runs_off_the_event_loop(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(config_text(2))
    watch, applied = watcher(path)
    path.write_text(config_text(5000))
    ticks = 0
    reload = asyncio.create_task(watch.check())
    while not reload.done():
        ticks += 1
        await asyncio.sleep(0.001)
    assert await reload and len(applied.calls) == 1
    # Parsing 5,000 tenants takes tens of ms at least; on the loop the ticker would get at
    # most the turns around it.
    assert ticks >= 5, ticks


async def test_changes_that_need_a_restart_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(config_text(2))
    watch, applied = watcher(path)
    changed = config_text(3, port=9001) + "server: {max_connections: 10}\nticket_secret_env: X\n"
    path.write_text(changed)
    with caplog.at_level(logging.WARNING, logger="tierproxy.reload"):
        assert await watch.check()
    assert len(applied.calls) == 1  # the rest of the file is applied
    for name in ("listen", "server", "ticket_secret_env"):
        assert f"{name} changed; it takes effect only after a restart" in caplog.text
    assert "admin_listen changed" not in caplog.text


async def test_every_read_at_start_section_is_named_when_it_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(config_text(2))
    watch, applied = watcher(path)
    changed = config_text(2) + (
        "shared_state: {url: 'redis://127.0.0.1:6379/0'}\n"
        f"usage_log: {{path: '{tmp_path / 'usage.jsonl'}'}}\n"
        "admin_listen: {host: 127.0.0.1, port: 9002}\n"
        "backend_health: {connect_timeout_s: 7}\n"
    )
    path.write_text(changed)
    with caplog.at_level(logging.WARNING, logger="tierproxy.reload"):
        assert await watch.check()
    assert len(applied.calls) == 1
    for name in ("shared_state", "usage_log", "admin_listen", "backend_health.connect_timeout_s"):
        assert f"{name} changed; it takes effect only after a restart" in caplog.text
    assert "listen changed" not in caplog.text.replace("admin_listen changed", "")


def test_every_section_is_either_live_or_read_at_start() -> None:
    """A new top-level section must be placed: applied by a reload, or named in the warning."""
    at_start = {name.split(".")[0] for name in RESTART_FIELDS if "." not in name}
    assert at_start.isdisjoint(LIVE_SECTIONS)
    assert set(Config.model_fields) == at_start | set(LIVE_SECTIONS)
