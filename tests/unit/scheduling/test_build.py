"""Policies chosen in YAML: the registry, the defaults, and a reload that changes them while
requests wait."""

from __future__ import annotations

import asyncio

import pytest

from proxy.config.loader import ConfigError, parse_config
from proxy.config.schema import LoadedConfig
from proxy.config.tenants import hash_key
from proxy.policies import registry
from proxy.policies.backends import LeastUtilised, PrefixAffinity
from proxy.policies.displacement import LargestShare
from proxy.policies.kvaware import KvAware
from proxy.policies.order import Fcfs, ShortFirst
from proxy.policies.tenants import EarliestDeadlineFirst, VirtualTokenCounter
from proxy.policies.tiers import StrideTierSelector
from proxy.policies.types import QueuedRequest
from proxy.scheduling.build import build_scheduling
from proxy.scheduling.dispatch import Lease
from proxy.server.state import ProxyState
from proxy.telemetry.metrics import ProxyMetrics
from tests.helpers.clock import FakeClock

BASE = f"""
tiers:
  normal: {{priority: 0, weight: 1, max_queue: 100, queue_timeout_s: 60, request_timeout_s: 60}}
tenants:
  - {{name: a, tier: normal, keys: [{{sha256: "{hash_key("key-a")}"}}]}}
  - {{name: b, tier: normal, keys: [{{sha256: "{hash_key("key-b")}"}}]}}
backends:
  - {{url: "http://127.0.0.1:9", max_inflight: 1}}
"""


def _config(policies: str = "") -> LoadedConfig:
    return parse_config(BASE + (f"policies: {{{policies}}}\n" if policies else ""))


def test_defaults_are_todays_policies() -> None:
    sched = build_scheduling(_config().config, ProxyMetrics(), FakeClock())
    chosen = sched.queue.policies
    assert isinstance(chosen.tiers, StrideTierSelector)
    assert isinstance(chosen.tenants, VirtualTokenCounter)
    assert isinstance(chosen.order, ShortFirst) and chosen.order.aging_s == 30.0
    assert isinstance(chosen.displacement, LargestShare)
    assert isinstance(sched.pool.chooser, LeastUtilised)


@pytest.mark.parametrize(
    ("seam", "name"), [(s, n) for s, names in registry.CHOICES.items() for n in names]
)
def test_every_registered_name_is_chosen_from_yaml(seam: str, name: str) -> None:
    config = _config(f"{seam}: {name}").config
    sched = build_scheduling(config, ProxyMetrics(), FakeClock())
    built = sched.pool.chooser if seam == "backends" else getattr(sched.queue.policies, seam)
    factory = registry.CHOICES[seam][name]
    assert callable(factory)
    assert type(built) is type(factory(config))


def test_unknown_policy_names_the_field_the_line_and_the_choices() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(BASE + "policies:\n  order: lifo\n")
    (problem,) = exc.value.problems
    assert problem.startswith("policies.order (line 10)")
    assert "Input should be 'short_first' or 'fcfs'" in problem


def _queued(state: ProxyState, tenant: str, arrival: float) -> tuple[asyncio.Future[Lease], int]:
    req = QueuedRequest("normal", tenant, prompt_tokens=10, expected_output=10, arrival_s=arrival)
    return state.dispatcher.enqueue(req), id(req)


async def test_reload_that_changes_policies_keeps_every_queued_request() -> None:
    clock = FakeClock()
    state = ProxyState(_config(), b"secret", clock)
    running, _ = _queued(state, "a", clock())
    waiting = [_queued(state, t, clock.advance(1.0))[0] for t in ("a", "a", "a", "b")]
    deadlines = sorted(r.deadline_s for r in state.queue.queued())
    assert running.done() and not any(w.done() for w in waiting)

    state.apply(_config("tenants: edf, order: fcfs, backends: prefix_affinity"))

    assert isinstance(state.queue.policies.tenants, EarliestDeadlineFirst)
    assert isinstance(state.queue.policies.order, Fcfs)
    assert isinstance(state.pool.chooser, PrefixAffinity)
    assert len(state.queue) == 4 and not any(w.done() for w in waiting)
    assert sorted(r.deadline_s for r in state.queue.queued()) == deadlines
    # Served by deadline now: the three of "a" before "b" (VTC would have put "b" second).
    order = []
    lease = running.result()
    for _ in waiting:
        lease.release()
        done = [w for w in waiting if w.done() and w not in order]
        assert len(done) == 1
        order.append(done[0])
        lease = done[0].result()
    assert order == waiting


async def test_reload_without_policy_change_keeps_the_fairness_history() -> None:
    clock = FakeClock()
    state = ProxyState(_config(), b"secret", clock)
    fairness = state.queue.policies.tenants
    assert isinstance(fairness, VirtualTokenCounter)
    _queued(state, "a", clock())
    state.apply(_config())
    assert state.queue.policies.tenants is fairness and fairness.counter("a") > 0


async def test_reload_of_a_chooser_parameter_builds_a_new_chooser_and_only_then() -> None:
    clock = FakeClock()
    state = ProxyState(_config("backends: kv_aware, kv_aware: {hold_s: 5}"), b"secret", clock)
    chooser = state.pool.chooser
    assert isinstance(chooser, KvAware) and chooser.holds == {"normal": 5.0}
    state.apply(_config("backends: kv_aware, kv_aware: {hold_s: 5}"))
    assert state.pool.chooser is chooser  # nothing changed: its memory of prefixes stays
    state.apply(_config("backends: kv_aware, kv_aware: {hold_s: 0}"))
    rebuilt = state.pool.chooser
    assert isinstance(rebuilt, KvAware) and rebuilt.holds == {"normal": 0.0}
    state.apply(_config("backends: kv_aware, kv_aware: {hold_s: 0, room_weight_best: 2}"))
    assert state.pool.chooser is not rebuilt


async def test_a_reload_tells_the_kept_chooser_the_tenants_files_cache_groups() -> None:
    """kv_aware's apart rule reads how many cache groups the tenants file has: a reload that
    changes them keeps the chooser (and its memory of prefixes) and tells it."""
    clock = FakeClock()
    state = ProxyState(_config("backends: kv_aware"), b"secret", clock)
    chooser = state.pool.chooser
    assert isinstance(chooser, KvAware) and chooser.cache_groups == 0
    grouped = BASE.replace("tier: normal,", "tier: normal, cache_group: g,", 1)
    grouped = grouped.replace("{name: b, tier: normal,", "{name: b, tier: normal, cache_group: h,")
    state.apply(parse_config(grouped + "policies: {backends: kv_aware}\n"))
    assert state.pool.chooser is chooser and chooser.cache_groups == 2
