"""A short run of `tierproxy bench` against a real vLLM (CPU, tiny model), directly and through
the proxy started as `tierproxy serve` on a config the bench writes. About 30 s once the engine
is up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from proxy.bench.capacity import measure_capacity
from proxy.bench.cli import main
from proxy.bench.proxy_config import proxy_config, write_proxy_config
from proxy.bench.scenario import load_scenario
from proxy.bench.stack import ProxyProcess
from proxy.tools.engine import EngineProcess, free_port
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import CORE

pytestmark = [pytest.mark.integration, pytest.mark.engines(CORE)]

SCENARIO = """
name: smoke
duration_s: 5
rate_rps: 6
slo:
  high: {ttft_s: 2.0}
tenants:
  - {name: chat-a, tier: high, share: 1, prompt_words: [4, 16], max_tokens: [4, 12]}
  - {name: chat-b, tier: high, share: 1, prompt_words: [4, 16], max_tokens: [4, 12]}
  - {name: batch,  tier: low,  share: 2, prompt_words: [16, 48], max_tokens: [8, 24],
     arrival: {process: gamma, cv: 2}}
"""


@pytest.fixture
def engine(engines: EngineFarm) -> EngineProcess:
    """The shared tiny engine; started here so that its start-up counts as setup, not as the
    smoke run."""
    return engines.get(CORE)


@pytest.mark.long  # a real load generator (`tierproxy bench`), direct and through the proxy
def test_bench_direct_and_through_the_proxy(engine: EngineProcess, tmp_path: Path) -> None:
    scenario_path = tmp_path / "smoke.yaml"
    scenario_path.write_text(SCENARIO)
    scenario = load_scenario(str(scenario_path))
    port = free_port()
    config = write_proxy_config(
        proxy_config(scenario, [engine.spec.url], port=port, max_inflight=4),
        tmp_path / "proxy.yaml",
        scenario,
    )
    out = tmp_path / "out"
    with ProxyProcess(config, port, tmp_path / "proxy.log") as proxy:
        proxy.start()
        code = main(
            [
                "--scenario",
                str(scenario_path),
                "--target",
                proxy.url,
                "--direct",
                engine.spec.url,
                "--out",
                str(out),
                "--request-timeout",
                "60",
            ]
        )
    assert code == 0  # 0 means: no request lost
    results = orjson.loads((out / "results.json").read_bytes())
    assert results["rate_rps"] == 6
    assert set(results["runs"]) == {"proxy", "direct"}
    sizes = {len(run["requests"]) for run in results["runs"].values()}
    assert len(sizes) == 1  # the same plan for both runs
    for label, run in results["runs"].items():
        report = run["report"]
        outcomes = report["total"]["outcomes"]
        assert outcomes["lost"] == 0, label
        assert outcomes["ok"] == report["total"]["requests"] > 10, (label, outcomes)
        assert set(report["tiers"]) == {"high", "low"}
        assert report["tiers"]["high"]["ttft_s"]["p99"] > 0
        assert report["tiers"]["high"]["slo_attainment"] is not None
        # Far below capacity nobody stays backlogged: the index may be None, never wrong.
        jain = report["fairness"]["high"]["jain"]
        assert jain is None or 0.5 <= jain <= 1.0
        assert report["total"]["output_tokens_per_s"] > 0
        # chat-a and chat-b ask for the same service: their TTFT spread is reported (how even
        # it must be is for the fairness scenario, not for a run this short and light).
        spread = report["latency_fairness"]["chat-a"]
        assert set(spread["ttft_p50_s"]) == {"chat-a", "chat-b"}
        assert spread["p50_ratio"] >= 1.0 and spread["p99_ratio"] >= 1.0
        for r in run["requests"]:
            assert r["ttft"] <= r["e2e"]
            assert r["output_tokens"] > 0
    assert results["runs"]["proxy"]["report"]["queue_depth_source"] == "proxy /metrics"
    assert (out / "ttft_cdf.png").stat().st_size > 1000
    assert (out / "queue_depth.png").stat().st_size > 1000


def test_capacity_step(engine: EngineProcess) -> None:
    scenario = load_scenario("seed-mixed")
    cap = asyncio.run(
        measure_capacity(
            scenario, engine.spec.url, "tiny", duration_s=5.0, warmup_s=1.0, concurrency=16
        )
    )
    # Answers counted in the window, and the rate made of them: not "over 1 a second", the
    # speed of a CPU engine on a host a busy CI can halve.
    assert cap.completed > 0 and cap.rps == round(cap.completed / cap.window_s, 3), cap
    assert cap.output_tokens_per_s > cap.rps
    assert cap.failed == 0
