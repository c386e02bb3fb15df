"""Scenario files, the plan built from them, and the proxy config that holds their keys."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from proxy.bench.plan import build_plan
from proxy.bench.proxy_config import proxy_config, validate
from proxy.bench.scenario import ScenarioError, available_scenarios, load_scenario
from proxy.config.tenants import hash_key

SHIPPED = ["burst", "fairness", "overload-2x", "seed-mixed"]


def test_shipped_scenarios_load() -> None:
    assert available_scenarios() == SHIPPED
    for name in SHIPPED:
        s = load_scenario(name)
        assert s.name == name
        assert s.relative  # all scale to the measured capacity
        for tier in s.slo:
            assert tier in s.tiers


def test_overload_extends_seed_mixed() -> None:
    base = load_scenario("seed-mixed")
    over = load_scenario("overload-2x")
    assert over.load_factor == 2 * base.load_factor
    assert over.tenants == base.tenants
    assert over.slo == base.slo


def test_burst_phases_are_ten_times_the_rate() -> None:
    burst = load_scenario("burst")
    factors = [p.factor for p in burst.timeline()]
    assert max(factors) == 10 * min(factors)
    assert burst.total_duration() == 45
    # --duration scales every phase.
    assert [p.duration_s for p in burst.timeline(90)] == [30, 20, 40]


def test_scenario_errors_name_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nload: 1\nrate_rps: 2\ntenants: [{name: a, tier: high}]\n")
    with pytest.raises(ScenarioError, match="load"):
        load_scenario(str(bad))
    bad.write_text("name: x\ntenants: [{name: a, tier: high, max_tokens: [9, 3]}]\n")
    with pytest.raises(ScenarioError, match="max_tokens"):
        load_scenario(str(bad))
    bad.write_text("name: x\nslo: {low: {ttft_s: 1}}\ntenants: [{name: a, tier: high}]\n")
    with pytest.raises(ScenarioError, match="low"):
        load_scenario(str(bad))
    with pytest.raises(ScenarioError, match="shipped"):
        load_scenario("no-such-scenario")


def test_extends_a_file_by_path(tmp_path: Path) -> None:
    child = tmp_path / "mine.yaml"
    child.write_text("extends: fairness\nname: mine\nduration_s: 5\n")
    s = load_scenario(str(child))
    assert s.name == "mine"
    assert s.duration_s == 5
    assert len(s.tenants) == 4


def test_plan_is_deterministic_sorted_and_follows_shares() -> None:
    s = load_scenario("fairness")
    plan = build_plan(s, rate_rps=20.0, seed=3, duration_s=100)
    assert plan == build_plan(s, rate_rps=20.0, seed=3, duration_s=100)
    assert plan != build_plan(s, rate_rps=20.0, seed=4, duration_s=100)
    assert [p.index for p in plan] == list(range(len(plan)))
    assert all(a.at <= b.at for a, b in itertools.pairwise(plan))
    assert len(plan) == pytest.approx(2000, rel=0.1)
    heavy = sum(1 for p in plan if p.tenant == "heavy")
    light = sum(1 for p in plan if p.tenant == "light-a")
    assert heavy / light == pytest.approx(4.0, rel=0.2)
    for p in plan:
        assert 32 <= p.max_tokens <= 64
        assert p.key == f"bench-{p.tenant}-key"
        assert p.tier == "normal"


def test_plan_is_bounded(tmp_path: Path) -> None:
    f = tmp_path / "s.yaml"
    f.write_text("name: s\nmax_requests: 50\ntenants: [{name: a, tier: high}]\n")
    with pytest.raises(ValueError, match="max_requests"):
        build_plan(load_scenario(str(f)), rate_rps=100.0, seed=1, duration_s=10)


def test_documents_are_long() -> None:
    s = load_scenario("seed-mixed")
    plan = build_plan(s, rate_rps=10.0, seed=1, duration_s=60)
    docs = [p for p in plan if p.tenant == "docs-team"]
    chats = [p for p in plan if p.tenant == "chat-app"]
    assert docs and chats
    assert min(len(p.prompt.split()) for p in docs) > max(len(p.prompt.split()) for p in chats)


def test_proxy_config_holds_every_tenant_key() -> None:
    s = load_scenario("seed-mixed")
    data = proxy_config(s, ["http://127.0.0.1:8100"], port=8001, max_inflight=6)
    loaded = validate(data)  # the proxy's own schema accepts it
    for tenant in s.tenants:
        found = loaded.tenant_for_key(tenant.api_key)
        assert found is not None
        assert found.name == tenant.name
        assert found.tier == tenant.tier
    assert data["listen"]["port"] == 8001
    assert data["backends"] == [{"url": "http://127.0.0.1:8100", "max_inflight": 6}]
    assert set(data["tiers"]) == {"high", "normal", "low"}
    assert hash_key("bench-chat-app-key") in str(data)
    assert "bench-chat-app-key" not in str(data)  # only hashes in the config itself
    with pytest.raises(ValueError):
        proxy_config(s, [])


def test_peers_group_tenants_of_equal_demand() -> None:
    peers = load_scenario("fairness").peers()
    assert peers == {
        "heavy": "heavy",
        "light-a": "light-a",
        "light-b": "light-a",
        "light-c": "light-a",
    }
    seed = load_scenario("seed-mixed")
    # Tenants that differ in anything but name and key are not peers.
    assert len(set(seed.peers().values())) == len(
        {t.model_dump_json(exclude={"name", "key"}) for t in seed.tenants}
    )
