"""`serve --workers N` divides the per-process bounds among the workers, so the port-wide totals
are the config's (issue 22: each worker took the whole of every bound)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.bench.inproc import SECRET, make_config
from proxy.config.loader import load_config, parse_config
from proxy.config.schema import Config
from proxy.ops import workers
from proxy.ops.reload import ConfigWatcher
from proxy.ops.worker_share import WorkerShare, shares_summary
from proxy.ops.workers import check_workers
from proxy.server.app import create_app
from proxy.server.state import STATE


def config(**extra: Any) -> Config:
    raw = make_config([{"url": "http://127.0.0.1:9", "max_cheap_inflight": 4}], **extra)
    return parse_config(yaml.safe_dump(raw)).config


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 7])
def test_the_shares_add_up_to_the_config(workers: int) -> None:
    cfg = config(server={"max_connections": 4096}, limits={"max_held_bytes": 1_000_000_007})
    parts = [WorkerShare(slot, workers).config(cfg) for slot in range(workers)]
    assert sum(p.server.max_connections for p in parts) == 4096
    assert sum(p.limits.max_held_bytes or 0 for p in parts) == 1_000_000_007
    for name, tier in cfg.tiers.items():
        assert sum(p.tiers[name].max_queue for p in parts) == tier.max_queue
    # A cap smaller than the workers: each keeps one (never 0, which would refuse everything).
    assert [p.backends[0].max_cheap_inflight for p in parts] == [
        WorkerShare(slot, workers).part(4) for slot in range(workers)
    ]
    assert all(p.backends[0].max_cheap_inflight >= 1 for p in parts)
    # Global bounds (through shared_state) and everything else stay as they are.
    assert all(p.tenants == cfg.tenants and p.relay == cfg.relay for p in parts)


def test_a_zero_bound_stays_zero_and_unbounded_stays_unbounded() -> None:
    cfg = config(tiers={"low": {"max_queue": 0}}, limits={"max_held_bytes": None})
    share = WorkerShare(1, 3).config(cfg)
    assert share.tiers["low"].max_queue == 0 and share.limits.max_held_bytes is None


def test_the_share_parses_as_the_owner_writes_it() -> None:
    assert WorkerShare.parse(str(WorkerShare(2, 5))) == WorkerShare(2, 5)
    with pytest.raises(ValueError):
        WorkerShare.parse("5/5")


def test_each_worker_is_started_with_its_own_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[list[str]] = []

    class Recorded:
        def __init__(self, command: list[str], name: str) -> None:
            started.append(command)
            self.pid = len(started)

        def start(self) -> Recorded:
            return self

    monkeypatch.setattr(workers, "ManagedProcess", Recorded)
    owner = workers.WorkerOwner(str(tmp_path / "c.yaml"), 3, None, 8000)
    for slot in range(3):
        owner._spawn(slot)
    assert [c[-2:] for c in started] == [["--worker-share", f"{n}/3"] for n in range(3)]


def test_the_owner_logs_the_totals_and_shares_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    raw = make_config(
        [{"url": "http://127.0.0.1:9"}],
        server={"max_connections": 1000},
        shared_state={"url": "redis://127.0.0.1:6379/0"},
    )
    raw["listen"]["port"] = 8123
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    with caplog.at_level(logging.INFO, logger="tierproxy.workers"):
        check_workers(str(path), 3, None)
    assert "server.max_connections: 1000 in all, 333/334 per worker" in caplog.text
    assert "tiers.low.max_queue: 500 in all, 166/167 per worker" in caplog.text
    assert shares_summary(load_config(path).config, 3)[0].startswith("server.max_connections")


async def test_a_reload_in_a_worker_keeps_its_share(tmp_path: Path) -> None:
    raw = make_config([{"url": "http://127.0.0.1:9"}], server={"max_connections": 100})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    share = WorkerShare(0, 4)
    app = create_app(share.apply(load_config(path)), secret=SECRET, transform=share.apply)
    state = app[STATE]
    assert state.config.server.max_connections == 25
    raw["tiers"]["high"]["max_queue"] = 40
    raw["limits"] = {"max_held_bytes": 4000}
    path.write_text(yaml.safe_dump(raw))
    assert state.watcher is None  # not watching: reload through a watcher made here
    watcher = ConfigWatcher(
        path, state.prepare, state.metrics, lambda: state.config, transform=share.apply
    )
    assert await watcher.reload()
    assert state.config.tiers["high"].max_queue == 10
    assert state.budget.limit_bytes == 1000
