"""PNG plot of ``benchmarks/adapters_bench.py``: each tier's TTFT CDF per mode (adapter-blind
``least_utilised`` against adapter-aware routing), and per mode the requests that waited inside
vLLM for an adapter slot, the adapter loads the proxy made and the output tokens/s."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from proxy.bench.plots import COLORS, pyplot, shrink

TIERS = ("high", "normal", "low")


def _deferred(result: Mapping[str, Any]) -> float:
    """Requests of the run that waited over ``waited_over_s`` inside vLLM's scheduler."""
    return float(result["waited_in_vllm"])


def adapter_figure(results: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """One TTFT CDF panel per tier (one line per mode; several rounds of a mode are pooled),
    then one panel of bars: deferred in vLLM and adapter loads per request, tok/s labelled."""
    plt = pyplot()
    modes = list(dict.fromkeys(r["mode"] for r in results))
    fig, axes = plt.subplots(1, len(TIERS) + 1, figsize=(3.1 * (len(TIERS) + 1), 2.9))
    for ax, tier in zip(axes, TIERS, strict=False):
        for i, mode in enumerate(modes):
            ttfts = sorted(
                t for r in results if r["mode"] == mode for t in r["ttfts"].get(tier, [])
            )
            if ttfts:
                ys = [(k + 1) / len(ttfts) for k in range(len(ttfts))]
                label = f"{mode.split(' ')[0]} (n={len(ttfts)})"
                ax.step(ttfts, ys, where="post", color=COLORS[i % len(COLORS)], label=label)
        ax.set_title(f"TTFT, tier {tier}", fontsize=8)
        ax.set_xlabel("seconds", fontsize=7)
        ax.set_ylim(0, 1.01)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="lower right")
    axes[0].set_ylabel("fraction of requests", fontsize=7)
    bars = axes[-1]
    kinds = (("waited in vLLM", _deferred), ("adapter loads", lambda r: r["adapter_loads"]))
    width = 0.8 / len(kinds)
    for k, (kind, value) in enumerate(kinds):
        xs, ys = [], []
        for i, mode in enumerate(modes):
            runs = [r for r in results if r["mode"] == mode]
            requests = sum(r["requests"] for r in runs)
            xs.append(i + (k - (len(kinds) - 1) / 2) * width)
            ys.append(100 * sum(value(r) for r in runs) / requests if requests else 0.0)
        bars.bar(xs, ys, width=width * 0.9, color=COLORS[(k + 2) % len(COLORS)], label=kind)
        for x, y in zip(xs, ys, strict=True):
            bars.text(x, y + 1, f"{y:.0f}", ha="center", fontsize=6)
    labels = []
    for mode in modes:
        runs = [r for r in results if r["mode"] == mode]
        tps = sum(r["output_tokens_per_s"] for r in runs) / len(runs)
        labels.append(f"{mode.split(' ')[0]}\n{tps:.0f} tok/s")
    bars.set_xticks(range(len(modes)), labels, fontsize=7)
    bars.set_ylabel("% of requests", fontsize=7)
    bars.set_title("per request", fontsize=8)
    bars.tick_params(labelsize=7)
    bars.grid(axis="y", alpha=0.3)
    bars.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return shrink(path)
