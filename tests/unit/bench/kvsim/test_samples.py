"""A shape judged on independent samples (proxy.bench.kvsim.samples) and how often its
verdicts agree (report.render_agreement)."""

from __future__ import annotations

from dataclasses import replace

from proxy.bench.kvsim.engine import EngineCosts
from proxy.bench.kvsim.family import load_family
from proxy.bench.kvsim.report import Figures, figures, render_agreement, verdict
from proxy.bench.kvsim.run import simulate
from proxy.bench.kvsim.samples import run_samples

POLICIES = ["least_utilised", "prefix_affinity", "kv_aware"]


def test_each_sample_draws_its_own_runs_and_the_last_pools_them_all() -> None:
    shape = load_family()[1].scenario
    one, two, pooled = run_samples(
        shape, POLICIES, EngineCosts(), replicas=2, samples=2, duration_s=10
    )
    # Sample 2 is replicas 2 and 3: drawn anew, not sample 1 again.
    second = [simulate(shape, "kv_aware", duration_s=10, replica=i) for i in (2, 3)]
    assert two["kv_aware"] == figures(second, 10)
    assert one["kv_aware"] != two["kv_aware"]
    for p in POLICIES:
        assert pooled[p].replicas == 4
        assert pooled[p].requests == one[p].requests + two[p].requests
    # One sample alone: as before, its first run the real client's draw.
    (alone,) = run_samples(shape, POLICIES, EngineCosts(), replicas=2, duration_s=10)
    assert alone == one


def _runs(kv_ttft: float) -> dict[str, Figures]:
    base = Figures("p", 10, 0, 100, 50, 0, 0, {"high": 100.0}, [0.5, 0.5], 0.5, 0.5, {"high": 9})
    base = replace(base, pooled_floor_share=0.5)  # not cache-bound: computed within 1.02
    return {
        "least_utilised": base,
        "prefix_affinity": replace(base, computed=60),
        "kv_aware": replace(base, ttft_p99={"high": kv_ttft}),
    }


def test_agreement_names_the_shapes_and_bars_whose_verdict_a_draw_changes() -> None:
    first = [("s1-a", _runs(90.0)), ("s2-b", _runs(90.0))]
    second = [("s1-a", _runs(90.0)), ("s2-b", _runs(120.0))]  # s2's tail: worse on this draw
    assert verdict("s2-b", second[1][1]).passes is False
    line = render_agreement([first, second])
    assert "every bar: 1 (s2 differ)" in line
    assert "best-tier tail: 1 (s2 differ)" in line
    assert "computed: 2;" in line and "engine share: 2" in line
