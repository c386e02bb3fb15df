"""Every registered policy alone against its seam's contract (what the seam's Protocol promises
in proxy/policies), whatever the sequence of events the queue or the pool may send it.

Parametrized over proxy.policies.registry: a policy added there is held to its seam's contract
with no test written for it. Each test plays the mechanism's part (the queue's backlog reports,
the pool's candidate filter) from a generated sequence of events and checks each answer:
- a tier selector picks only a tier with work, and one whenever some tier has work;
- a tenant chooser picks only a tenant backlogged in the tier that ``accept`` allows, and one
  whenever there is such a tenant;
- a request order gives each request a finite key, the same each time, and never puts an
  identical request that arrived later ahead of an earlier one;
- a displacement names a tenant backlogged in the full tier other than the newcomer's, or None;
- a backend chooser gives no room to a backend that cannot take work, never more than its room
  less what is in flight, and picks only among the candidates it is given (None when none).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.backends.backend import BackendState
from proxy.bench.inproc import make_config
from proxy.config.backends import Backend, BackendHealth
from proxy.config.loader import parse_config
from proxy.config.schema import Config
from proxy.policies.backends import Candidate, slot_room
from proxy.policies.backlog import TenantBacklog
from proxy.policies.registry import BACKENDS, CHOICES, DISPLACEMENTS, ORDERS, TENANTS, TIERS
from proxy.policies.types import QueuedRequest, ScrapedLoad, TierLimits

T = TypeVar("T")
CONFIG = parse_config(yaml.safe_dump(make_config([{"url": "http://b:1"}])), "conformance").config
TIER_NAMES = ("high", "normal", "low")
TENANT_NAMES = ("a", "b", "c", "d")
LIMITS = {
    "high": TierLimits(weight=10, max_queue=5, queue_timeout_s=60, priority=0),
    "normal": TierLimits(weight=5, max_queue=5, queue_timeout_s=60, priority=5),
    "low": TierLimits(weight=1, max_queue=5, queue_timeout_s=60, priority=10),
}
EXAMPLES = settings(max_examples=60, deadline=None)


def build(registry: Mapping[str, Callable[[Config], T]], name: str) -> T:
    return registry[name](CONFIG)


def test_every_seam_of_the_config_is_checked_here() -> None:
    checked = {"tiers": TIERS, "tenants": TENANTS, "order": ORDERS}
    checked |= {"displacement": DISPLACEMENTS, "backends": BACKENDS}
    assert checked == dict(CHOICES)


# -- the queue's backlog, as the tenant and displacement policies are told of it ------------------


@dataclass
class Backlogs:
    """The queue's side: who has what queued in which tier, reported as the queue reports it."""

    queued: dict[tuple[str, str], list[QueuedRequest]] = field(default_factory=dict)
    since: dict[tuple[str, str], int] = field(default_factory=dict)
    seq: int = 0

    def of(self, tier: str) -> set[str]:
        return {tenant for (t, tenant), reqs in self.queued.items() if t == tier and reqs}

    def push(self, tier: str, tenant: str, arrival: float, weight: float) -> TenantBacklog:
        reqs = self.queued.setdefault((tier, tenant), [])
        if not reqs:
            self.since[(tier, tenant)] = self.seq
        req = QueuedRequest(tier, tenant, 10, 10, arrival, tenant_weight=weight, seq=self.seq)
        self.seq += 1
        reqs.append(req)
        return self.backlog(tier, tenant)

    def pop_oldest(self, tier: str, tenant: str) -> TenantBacklog | None:
        reqs = self.queued[(tier, tenant)]
        reqs.remove(min(reqs, key=lambda r: (r.arrival_s, r.seq)))
        return self.backlog(tier, tenant) if reqs else None

    def backlog(self, tier: str, tenant: str) -> TenantBacklog:
        reqs = self.queued[(tier, tenant)]
        oldest = min(reqs, key=lambda r: (r.arrival_s, r.seq))
        since = self.since[(tier, tenant)]
        return TenantBacklog(len(reqs), reqs[-1].tenant_weight, oldest, since)


# (push?, tier, tenant, arrival, weight, which tenants ``accept`` allows)
Event = tuple[bool, str, str, float, float, frozenset[str]]
EVENTS = st.lists(
    st.tuples(
        st.booleans(),
        st.sampled_from(TIER_NAMES),
        st.sampled_from(TENANT_NAMES),
        st.floats(0, 1000, allow_nan=False),
        st.sampled_from((0.5, 1.0, 3.0)),
        st.frozensets(st.sampled_from(TENANT_NAMES)),
    ),
    max_size=80,
)


# -- tiers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TIERS))
@EXAMPLES
@given(steps=st.lists(st.frozensets(st.sampled_from(TIER_NAMES)), max_size=60))
def test_a_tier_selector_picks_only_a_tier_with_work(
    name: str, steps: list[frozenset[str]]
) -> None:
    selector = build(TIERS, name)
    selector.set_tiers(LIMITS)
    backlogged: set[str] = set()
    for with_work in steps:
        for tier in sorted(with_work - backlogged):  # the queue: empty -> non-empty
            selector.activate(tier, sorted(backlogged))
            backlogged.add(tier)
        backlogged &= with_work  # the others emptied (dispatched, expired, removed)
        picked = selector.pick(sorted(backlogged))
        if not backlogged:
            assert picked is None
            continue
        assert picked in backlogged, (picked, backlogged)
        selector.charge(picked)
    selector.set_tiers({"normal": LIMITS["normal"]})  # a reload drops tiers
    selector.activate("normal", [])
    assert selector.pick(["normal"]) == "normal"


# -- tenants -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TENANTS))
@EXAMPLES
@given(events=EVENTS)
def test_a_tenant_chooser_picks_only_a_backlogged_tenant_that_accept_allows(
    name: str, events: list[Event]
) -> None:
    chooser = build(TENANTS, name)
    queue = Backlogs()
    for push, tier, tenant, arrival, weight, allowed in events:
        if push:
            chooser.backlog_changed(tier, tenant, queue.push(tier, tenant, arrival, weight))
            continue
        eligible = queue.of(tier) & allowed
        picked = chooser.pick(tier, allowed.__contains__)
        if not eligible:
            assert picked is None, (picked, queue.of(tier), allowed)
        else:
            assert picked in eligible, (picked, eligible)
        unfiltered = chooser.pick(tier)
        assert (unfiltered is None) == (not queue.of(tier))
        assert unfiltered is None or unfiltered in queue.of(tier)
        if picked is not None:  # dispatched: the queue reports the change, then charges
            chooser.backlog_changed(tier, picked, queue.pop_oldest(tier, picked))
            chooser.charge(picked, 20.0, weight)
            chooser.charge(picked, -5.0, weight)  # the correction once the usage is known
    chooser.forget(["a"])  # a reload keeps only tenant a: the backlogs still drain
    for tier in TIER_NAMES:
        assert (chooser.pick(tier) is None) == (not queue.of(tier))


# -- request order -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ORDERS))
@EXAMPLES
@given(
    prompt=st.integers(0, 100_000),
    output=st.integers(0, 100_000),
    arrival=st.floats(0, 1e7, allow_nan=False),
    later_by=st.floats(0, 1e5, allow_nan=False),
)
def test_a_request_order_keys_each_request_alike_and_never_lets_a_later_twin_ahead(
    name: str, prompt: int, output: int, arrival: float, later_by: float
) -> None:
    order = build(ORDERS, name)
    first = QueuedRequest("normal", "a", prompt, output, arrival)
    twin = QueuedRequest("normal", "a", prompt, output, arrival + later_by)
    key = order.key(first)
    assert math.isfinite(key) and order.key(first) == key
    assert first.arrival_s == arrival and first.cost == twin.cost  # the key left them as they were
    assert key <= order.key(twin)


# -- displacement ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DISPLACEMENTS))
@EXAMPLES
@given(events=EVENTS)
def test_a_displacement_names_a_tenant_of_the_full_tier_other_than_the_newcomers(
    name: str, events: list[Event]
) -> None:
    displacement = build(DISPLACEMENTS, name)
    queue = Backlogs()
    for push, tier, tenant, arrival, weight, _ in events:
        if not push:
            if tenant in queue.of(tier):
                displacement.backlog_changed(tier, tenant, queue.pop_oldest(tier, tenant))
            continue
        newcomer = QueuedRequest(tier, tenant, 10, 10, arrival, tenant_weight=weight)
        mine = len(queue.queued.get((tier, tenant), []))
        victim = displacement.victim(tier, newcomer, mine)
        assert victim is None or victim in queue.of(tier) - {tenant}, (victim, queue.of(tier))
        if victim is not None:  # the queue drops the victim's newest, as it would
            reqs = queue.queued[(tier, victim)]
            reqs.pop()
            displacement.backlog_changed(
                tier, victim, queue.backlog(tier, victim) if reqs else None
            )
        displacement.backlog_changed(tier, tenant, queue.push(tier, tenant, arrival, weight))


# -- backends ----------------------------------------------------------------------------------

HEALTH = BackendHealth()

# Per backend: (max_inflight, inflight, healthy, draining, ejected, vLLM's queue or None)
BackendCase = tuple[int, int, bool, bool, bool, int | None]
BACKEND_CASES = st.lists(
    st.tuples(
        st.integers(1, 8),
        st.integers(0, 10),
        st.booleans(),
        st.booleans(),
        st.booleans(),
        st.none() | st.integers(0, 12),
    ),
    min_size=1,
    max_size=4,
)


@pytest.mark.parametrize("name", sorted(BACKENDS))
@EXAMPLES
@given(
    rounds=st.lists(
        st.tuples(BACKEND_CASES, st.none() | st.integers(0, 3)), min_size=1, max_size=20
    )
)
def test_a_backend_chooser_gives_room_only_where_there_is_some_and_picks_a_candidate(
    name: str, rounds: list[tuple[list[BackendCase], int | None]]
) -> None:
    chooser = build(BACKENDS, name)
    now = 100.0
    for cases, prefix in rounds:
        states: list[BackendState] = []
        for i, (cap, inflight, healthy, draining, ejected, waiting) in enumerate(cases):
            state = BackendState(Backend(url=f"http://b{i}:80", max_inflight=cap))
            state.inflight, state.healthy, state.draining = inflight, healthy, draining
            state.ejected_until = now + 5 if ejected else 0.0
            if waiting is not None:
                state.load = ScrapedLoad(waiting=waiting, running=inflight, kv_usage=0.5, at=now)
            states.append(state)
        candidates = []
        for state in states:
            room = slot_room(state, now, HEALTH)  # the pool's, whichever chooser
            assert 0.0 <= room <= max(0.0, state.max_room - state.inflight), (state, room)
            if not state.available(now):
                assert room == 0.0
            if room >= 1.0:  # the pool's filter
                candidates.append(Candidate(state, room, state.fresh_load(now, 2.0)))
        request = QueuedRequest("n", "t", 10, 10, now, prefix_hash=prefix)
        if prefix is not None:
            request.prompt_blocks = tuple(range(prefix))
        picked = chooser.pick(candidates, request)
        if not candidates:
            assert picked is None
            continue
        assert any(picked is c.state for c in candidates), (picked, candidates)
        assert picked is not None
        chooser.served(picked, request)
        chooser.ended(picked, request, ran=bool(prefix))  # every chooser hears how it ended
