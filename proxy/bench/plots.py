"""PNG plots: TTFT CDF per tier (proxy vs direct) and queue depth over time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from proxy.bench.records import Outcome, RequestRecord
from proxy.bench.runner import Sample

_STYLES = {"proxy": "-", "direct": "--"}
COLORS = ["tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown"]


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ttft_cdf(
    records: Mapping[str, Sequence[RequestRecord]], tiers: Sequence[str], path: Path
) -> Path:
    """One panel per tier; one line per run (proxy solid, direct dashed); log time axis."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(tiers), figsize=(3.6 * len(tiers), 3.0), squeeze=False)
    for ax, tier in zip(axes[0], tiers, strict=True):
        for i, (label, recs) in enumerate(records.items()):
            ttfts = sorted(
                r.ttft
                for r in recs
                if r.tier == tier and r.outcome is Outcome.OK and r.ttft is not None
            )
            if not ttfts:
                continue
            ys = [(k + 1) / len(ttfts) for k in range(len(ttfts))]
            ax.step(
                ttfts,
                ys,
                where="post",
                linestyle=_STYLES.get(label, ":"),
                color=COLORS[i % len(COLORS)],
                label=f"{label} (n={len(ttfts)})",
            )
        ax.set_xscale("log")
        ax.set_title(f"TTFT, tier {tier}", fontsize=9)
        ax.set_xlabel("seconds from scheduled send", fontsize=8)
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
        else:
            ax.text(0.5, 0.5, "no ok requests", ha="center", transform=ax.transAxes, fontsize=8)
    axes[0][0].set_ylabel("fraction of ok requests", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return shrink(path)


def queue_depth(samples: Mapping[str, Sequence[Sample]], tiers: Sequence[str], path: Path) -> Path:
    """One panel per run: the proxy's queue depth per tier when it exports it (solid), the
    client's in-flight count per tier (thin dashed), vLLM's own waiting queue (black dotted)."""
    plt = pyplot()
    fig, axes = plt.subplots(
        len(samples), 1, figsize=(7.5, 2.4 * len(samples)), squeeze=False, sharex=True
    )
    for ax, (label, ss) in zip(axes[:, 0], samples.items(), strict=True):
        ts = [s.t for s in ss]
        for i, tier in enumerate(tiers):
            color = COLORS[i % len(COLORS)]
            if any(s.queue_depth for s in ss):
                ax.plot(
                    ts,
                    [(s.queue_depth or {}).get(tier, 0.0) for s in ss],
                    color=color,
                    label=f"{tier} queued in proxy",
                )
            ax.plot(
                ts,
                [s.inflight.get(tier, 0) for s in ss],
                color=color,
                linestyle="--",
                linewidth=0.8,
                label=f"{tier} in flight (client)",
            )
        waiting = [s.engine_waiting for s in ss]
        if any(w for w in waiting):  # some vLLM builds leave this gauge at 0: then hide it
            ax.plot(
                ts, [w or 0.0 for w in waiting], color="black", linestyle=":", label="vLLM waiting"
            )
        ax.set_title(label, fontsize=9)
        ax.set_ylabel("requests", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="upper left", ncol=2)
    axes[-1][0].set_xlabel("seconds since start", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return shrink(path)


def shrink(path: Path) -> Path:
    """A 64-colour palette: line plots look the same at a third of the bytes."""
    from PIL import Image

    with Image.open(path) as img:
        small = img.convert("RGB").quantize(colors=64)
    small.save(path, optimize=True)
    return path
