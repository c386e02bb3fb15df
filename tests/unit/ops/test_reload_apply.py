"""A reload applied in two steps: planned in the worker thread, committed on the event loop in
O(changed tenants); the limits of unchanged tenants kept as they are."""

from __future__ import annotations

import asyncio
import threading
import weakref
from pathlib import Path

import yaml

from proxy.config.loader import load_config, parse_config
from proxy.config.tenants import Tenant, hash_key
from proxy.ops.reload import ConfigWatcher
from proxy.scheduling.limits import LimitRegistry, plan_changes
from proxy.server.state import ProxyState
from proxy.telemetry.metrics import ProxyMetrics
from tests.helpers.clock import FakeClock


def _tenant(name: str, **limits: object) -> Tenant:
    keys = [{"sha256": hash_key(f"key-{name}")}]
    return Tenant(name=name, tier="normal", keys=keys, **limits)


def _config(tenants: list[dict[str, object]]) -> str:
    data = {
        "tiers": {
            "normal": {
                "priority": 0,
                "weight": 1,
                "max_queue": 100,
                "queue_timeout_s": 60,
                "request_timeout_s": 60,
            }
        },
        "tenants": [
            {"name": t["name"], "tier": "normal", "keys": [{"sha256": hash_key(f"k-{t['name']}")}]}
            | {k: v for k, v in t.items() if k != "name"}
            for t in tenants
        ],
        "backends": [{"url": "http://127.0.0.1:9", "max_inflight": 1}],
    }
    return yaml.safe_dump(data)


def test_the_plan_holds_only_new_changed_and_removed_tenants() -> None:
    old = [_tenant("same", requests_per_minute=60), _tenant("faster", requests_per_minute=60)]
    old.append(_tenant("gone"))
    new = [_tenant("same", requests_per_minute=60, weight=5.0)]  # weight is no limit
    new += [_tenant("faster", requests_per_minute=600), _tenant("added", tokens_per_minute=10)]
    changes = plan_changes(old, new)
    assert [t.name for t in changes.changed] == ["faster", "added"]
    assert changes.removed == ("gone",)
    assert changes.names == {"same", "faster", "added"}


def test_applied_changes_keep_unchanged_limiters_and_match_a_full_configure() -> None:
    old = [_tenant("a", requests_per_minute=2), _tenant("b", requests_per_minute=2)]
    new = [_tenant("a", requests_per_minute=2), _tenant("b", requests_per_minute=4)]
    planned, full = LimitRegistry(), LimitRegistry()
    for reg in (planned, full):
        reg.configure(old, now=0.0)
        for tenant in ("a", "a", "b", "b"):
            assert reg.try_admit(tenant, 1, 0.0).allowed
    planned.apply_changes(plan_changes(old, new), now=0.0)
    full.configure(new, now=0.0)
    for reg in (planned, full):
        # Both buckets stay spent (a fresh limiter would admit at once); b refills twice as
        # fast: 4 per minute, one every 15 s.
        assert not reg.try_admit("a", 1, 0.0).allowed
        assert not reg.try_admit("b", 1, 0.0).allowed
        assert reg.try_admit("b", 1, 15.0).allowed and not reg.try_admit("a", 1, 15.0).allowed
        assert reg.concurrent("a") == 2


def test_a_removed_tenant_with_requests_running_lingers_until_idle() -> None:
    reg = LimitRegistry()
    v1 = [_tenant("a", max_concurrent=1), _tenant("b")]
    v2 = [_tenant("b")]
    reg.configure(v1, now=0.0)
    assert reg.try_admit("a", 1, 0.0).allowed
    reg.apply_changes(plan_changes(v1, v2), now=0.0)
    assert reg.concurrent("a") == 1  # still counted while it runs
    reg.settle("a", 1, 1, 1.0)
    v3 = [_tenant("b", requests_per_minute=5)]  # a is in neither v2 nor v3
    reg.apply_changes(plan_changes(v2, v3), now=1.0)
    # Gone: an unknown tenant is not limited, so max_concurrent 1 no longer holds.
    assert reg.try_admit("a", 1, 1.0).allowed and reg.try_admit("a", 1, 1.0).allowed


def test_a_commit_planned_against_an_older_config_falls_back_to_a_full_configure() -> None:
    clock = FakeClock()
    v1 = parse_config(_config([{"name": "a", "requests_per_minute": 1}]))
    v2 = parse_config(_config([{"name": "a", "requests_per_minute": 1}, {"name": "b"}]))
    v3 = parse_config(_config([{"name": "a", "requests_per_minute": 2}]))
    state = ProxyState(v1, b"secret", clock)
    limits = state.limits
    assert isinstance(limits, LimitRegistry)  # no shared_state: this process's registry
    assert limits.try_admit("a", 1, clock()).allowed
    stale = state.prepare(v3)  # planned against v1: a changed, nothing removed
    state.apply(v2)  # b arrives meanwhile
    assert stale() is v2 and state.loaded is v3
    assert not limits.try_admit("a", 1, clock()).allowed  # a's level kept: spent
    clock.advance(30.0)  # the new limit refills 2 a minute: one in 30 s
    assert limits.try_admit("a", 1, clock()).allowed
    # b, missing from v3, is gone (the stale plan alone would have kept it).
    assert "b" not in limits._by_tenant


async def test_the_replaced_config_is_freed_off_the_event_loop(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(_config([{"name": f"t{i}"} for i in range(3)]))
    state = ProxyState(load_config(path), b"secret", FakeClock())
    freed_in: list[str] = []
    weakref.finalize(state.loaded.config, lambda: freed_in.append(threading.current_thread().name))

    async def no_sleep(seconds: float) -> None:
        pass

    watch = ConfigWatcher(path, state.prepare, state.metrics, lambda: state.config, sleep=no_sleep)
    path.write_text(_config([{"name": f"t{i}"} for i in range(4)]))
    assert await watch.check()
    assert len(state.config.tenants) == 4
    assert freed_in and freed_in != [threading.main_thread().name]


async def test_metrics_count_the_event_loops_tasks_and_the_process() -> None:
    metrics = ProxyMetrics()
    before = metrics.registry.get_sample_value("tierproxy_event_loop_tasks")
    sleepers = [asyncio.create_task(asyncio.sleep(60)) for _ in range(5)]
    after = metrics.registry.get_sample_value("tierproxy_event_loop_tasks")
    for task in sleepers:
        task.cancel()
    await asyncio.gather(*sleepers, return_exceptions=True)
    assert before is not None and after == before + 5
    assert (metrics.registry.get_sample_value("process_open_fds") or 0) > 0
