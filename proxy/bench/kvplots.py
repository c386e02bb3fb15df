"""PNG plots of ``benchmarks/kv_routing.py``: prefill computed per policy and round (the
cache's effect), and each tier's TTFT CDF per policy (what it costs or saves in latency)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from proxy.bench.kvbench import RunFigures
from proxy.bench.plots import COLORS, pyplot, shrink


def prefill_bars(runs: Sequence[RunFigures], path: Path) -> Path:
    """Prefill computed as a share of the prompt tokens, one bar per policy and round."""
    plt = pyplot()
    policies = list(dict.fromkeys(r.policy for r in runs))
    rounds = sorted({r.round for r in runs})
    fig, ax = plt.subplots(figsize=(1.1 + 1.2 * len(policies), 3.0))
    width = 0.8 / len(rounds)
    for k, round_ in enumerate(rounds):
        xs, ys = [], []
        for i, policy in enumerate(policies):
            for r in runs:
                if r.policy == policy and r.round == round_ and r.prompt_tokens:
                    xs.append(i + (k - (len(rounds) - 1) / 2) * width)
                    ys.append(100 * r.prefill_computed / r.prompt_tokens)
        ax.bar(xs, ys, width=width * 0.9, color=COLORS[k % len(COLORS)], label=f"round {round_}")
        for x, y in zip(xs, ys, strict=True):
            ax.text(x, y + 0.5, f"{y:.0f}", ha="center", fontsize=6)
    ax.set_xticks(range(len(policies)), policies, fontsize=7)
    ax.set_ylabel("prefill computed, % of prompt tokens", fontsize=7)
    ax.tick_params(labelsize=7)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return shrink(path)


def ttft_cdfs(run_dirs: dict[str, Path], tiers: Sequence[str], path: Path) -> Path:
    """One panel per tier, one line per policy (its ``records.json``); log time axis."""
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, len(tiers), figsize=(3.4 * len(tiers), 2.8), squeeze=False)
    records = {p: json.loads((d / "records.json").read_text()) for p, d in run_dirs.items()}
    for ax, tier in zip(axes[0], tiers, strict=True):
        for i, (policy, recs) in enumerate(records.items()):
            ttfts = sorted(
                r["ttft"] for r in recs if r["tier"] == tier and r["status"] == 200 and r["ttft"]
            )
            if ttfts:
                ys = [(k + 1) / len(ttfts) for k in range(len(ttfts))]
                ax.step(ttfts, ys, where="post", color=COLORS[i % len(COLORS)], label=policy)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_minor_formatter(NullFormatter())  # log minor labels overlap
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x * 1000:g} ms"))
        ax.set_title(f"TTFT, tier {tier}", fontsize=8)
        ax.set_xlabel("time to first token (log)", fontsize=7)
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="lower right")
    axes[0][0].set_ylabel("fraction of requests", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return shrink(path)
