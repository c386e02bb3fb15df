"""Conversation scenarios (proxy.bench.conversations), their load (convclient) against a fake
vLLM, and the figures of a kv-routing run (kvbench)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.bench.convclient import ChatRecord, run_load
from proxy.bench.conversations import (
    ConversationScenario,
    ConversationTenant,
    available_conversation_scenarios,
    load_conversation_scenario,
)
from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.kvbench import engine_args, figures, proxy_config, render
from proxy.bench.kvsim.family import load_family
from proxy.bench.scenario import ScenarioError
from proxy.config.loader import parse_config


def test_the_shipped_scenario_loads_and_a_tenant_is_a_chat_or_a_flood() -> None:
    assert "prefix-cache" in available_conversation_scenarios()
    s = load_conversation_scenario("prefix-cache")
    assert {t.tier for t in s.tenants} == {"high", "normal", "low"}
    assert sum(t.conversations for t in s.tenants) > 0 and any(t.rate_rps for t in s.tenants)
    with pytest.raises(ValueError, match="not both"):
        ConversationTenant(name="x", tier="low", conversations=1, rate_rps=1.0)
    with pytest.raises(ScenarioError, match="shipped: prefix-cache"):
        load_conversation_scenario("no-such")


def test_the_proxy_config_of_a_run_is_valid_and_names_the_policy(tmp_path: Path) -> None:
    s = load_conversation_scenario("prefix-cache")
    data = proxy_config(s, ["http://127.0.0.1:1", "http://127.0.0.1:2"], "kv_aware", tmp_path)
    cfg = parse_config(yaml.safe_dump(data)).config
    assert cfg.policies.backends == "kv_aware" and len(cfg.backends) == 2
    assert {t.name for t in cfg.tenants} == {t.name for t in s.tenants}


async def test_a_conversation_resends_its_history_growing_turn_by_turn() -> None:
    chat = ConversationTenant(
        name="c", tier="high", conversations=1, system_words=20, turns=3, think_s=(0, 0)
    )
    # Long enough for a second conversation's first turn on a busy machine (dozens here).
    scenario = ConversationScenario(name="t", duration_s=3, tenants=[chat])
    fake = FakeVLLM(usage=(50, 4))
    async with fake.serve() as url:
        records = await run_load(url, scenario, 0.3)
    bodies = [r.body["messages"] for r in fake.received if r.path == "/v1/chat/completions"]
    assert len(bodies) >= 3 and all(r.status == 200 and r.ttft is not None for r in records)
    system = chat.system_prompt()
    for turn, messages in enumerate(bodies[:3], start=1):
        assert messages[0] == {"role": "system", "content": system}
        assert len(messages) == 2 * turn  # system, then user/assistant pairs, then the user
        if turn > 1:
            assert messages[: 2 * turn - 2] == bodies[turn - 2][: 2 * turn - 2]
    # A new conversation starts over from the system prompt, with other words.
    assert bodies[3][:1] == bodies[0][:1] and bodies[3][1] != bodies[0][1]
    assert [r.turn for r in records[:4]] == [1, 2, 3, 1]


def _rec(tier: str, ttft: float, status: int = 200) -> ChatRecord:
    return ChatRecord("t", tier, "turn", 1, 0.0, ttft, 1.0, status, 100, 10, 64)


def test_figures_count_what_vllm_computed_and_the_index_accuracy() -> None:
    before = [{"prompt": 0.0, "hits": 0.0, "queries": 0.0, "requests": 0.0, "preemptions": 0.0}] * 2
    after = [
        {"prompt": 1000.0, "hits": 600.0, "queries": 1000.0, "requests": 3.0, "preemptions": 0.0},
        {"prompt": 1000.0, "hits": 200.0, "queries": 1000.0, "requests": 1.0, "preemptions": 1.0},
    ]
    usage: list[dict[str, Any]] = [
        {"predicted_cached_tokens": 64, "cached_prompt_tokens": 64},
        {"predicted_cached_tokens": 32, "cached_prompt_tokens": 64},
        {"predicted_cached_tokens": None, "cached_prompt_tokens": 0},
    ]
    records = [_rec("high", 0.1), _rec("high", 0.3), _rec("low", 0.2), _rec("low", 0, 503)]
    f = figures("kv_aware", 1, records, before, after, usage, duration_s=10, block_size=32)
    assert (f.prompt_tokens, f.prefill_computed, f.hit_rate) == (2000, 1200, 0.4)
    assert f.engine_share == [0.75, 0.25] and f.failed == 1 and f.output_tok_s == 3.0
    assert f.index_exact == 0.5 and f.index_compared == 2
    assert f.ttft_ms["low"] == (200, 200)
    # The served turns' own cost, from vLLM's cached_tokens (64 of 100 each): one tenant here.
    assert f.tenant_shares == {"t": pytest.approx(0.36)}
    # Neither a flood request, nor a failed turn, nor one whose cached tokens vLLM did not
    # say, counts in a tenant's share.
    others = [
        ChatRecord("flood", "low", "flood", 0, 0.0, 0.1, 1.0, 200, 100, 10, 0),
        ChatRecord("t", "high", "turn", 2, 0.0, None, 1.0, 503, 100, 0, 0),
        ChatRecord("t", "high", "turn", 3, 0.0, 0.1, 1.0, 200, 100, 10, None),
    ]
    g = figures("kv_aware", 1, records + others, before, after, usage, 10, 32)
    assert g.tenant_shares == f.tenant_shares
    base = figures("least_utilised", 1, records, before, [after[0], after[0]], [], 10, 32)
    table = render([base, f])
    assert "| `kv_aware` | 1 | 4 (1) | 1,200 of 2,000 (60%) | 1.50 | 36% | 40% |" in table
    assert "50.0% of 2" in table and "| n/a |" in table


def test_a_family_shape_runs_on_real_engines_with_its_settings_and_cache_groups() -> None:
    shape = next(s for s in load_family() if any(t.shared_words for t in s.scenario.tenants))
    scenario = shape.scenario
    args = engine_args(scenario)
    assert args[:2] == ["--num-gpu-blocks-override", str(scenario.engine.kv_blocks)]
    assert args[2:] == ["--max-num-batched-tokens", "2048"]
    urls = [f"http://e{i}:1" for i in range(scenario.engines)]
    data = proxy_config(scenario, urls, "kv_aware", Path("/tmp/usage.jsonl"))
    groups = {t["name"]: t.get("cache_group") for t in data["tenants"]}
    assert groups == {t.name: t.cache_group for t in scenario.tenants}
    assert len(data["backends"]) == scenario.engines
    # Tenants of one group open their system prompts with the same preamble.
    a, b = [t for t in scenario.tenants if t.cache_group == "g0"][:2]
    shared = " ".join(a.system_prompt().split()[: a.shared_words])
    assert b.system_prompt().startswith(shared) and a.system_prompt() != b.system_prompt()
