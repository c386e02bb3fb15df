"""A shape's figures per policy on one or more independent samples (issue 32's family): a
sample pools as many runs as the best tier's tail needs (``report.replicas_for``), each run's
clients drawn anew; a second sample as large, drawn anew again, shows whether a verdict is the
shape's or its draw's (``report.render_agreement``)."""

from __future__ import annotations

from proxy.bench.conversations import ConversationScenario
from proxy.bench.kvsim.engine import EngineCosts
from proxy.bench.kvsim.report import Figures, figures, replicas_for
from proxy.bench.kvsim.run import simulate


def run_samples(
    scenario: ConversationScenario,
    policies: list[str],
    costs: EngineCosts,
    *,
    replicas: int | None = None,
    samples: int = 1,
    duration_s: float | None = None,
) -> list[dict[str, Figures]]:
    """Each policy's figures on ``samples`` samples of ``replicas`` runs (None: as many as the
    best tier's tail needs), sample j of replicas j*n to (j+1)*n - 1 (replica 0: the real
    client's draw), then, when ``samples`` > 1, of all of them pooled."""
    duration = duration_s or scenario.duration_s

    first = {p: [simulate(scenario, p, costs=costs, duration_s=duration)] for p in policies}
    if replicas is None:
        replicas = replicas_for({p: figures(r, duration) for p, r in first.items()})
    n = replicas
    runs = {
        p: r
        + [
            simulate(scenario, p, costs=costs, duration_s=duration, replica=i)
            for i in range(1, n * samples)
        ]
        for p, r in first.items()
    }
    out = [
        {p: figures(r[j * n : (j + 1) * n], duration) for p, r in runs.items()}
        for j in range(samples)
    ]
    if samples > 1:
        out.append({p: figures(r, duration) for p, r in runs.items()})
    return out
