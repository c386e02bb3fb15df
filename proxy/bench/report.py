"""From a run's records to the numbers a person reads: per tier, per tenant, totals, tables."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.bench.records import OUTCOMES, Outcome, RequestRecord
from proxy.bench.runner import RunResult
from proxy.bench.stats import (
    Slo,
    Summary,
    backlogged_fairness,
    goodput,
    latency_spread,
    makespan,
    summarize,
)


def group_report(
    records: Sequence[RequestRecord], window_s: float, slo: Slo | None
) -> dict[str, Any]:
    """Latencies, throughput, goodput and outcome counts of one group of requests."""
    ok = [r for r in records if r.outcome is Outcome.OK]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    itl = [gap for r in ok for gap in r.itls]
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    window = window_s if window_s > 0 else 1.0
    report: dict[str, Any] = {
        "requests": len(records),
        "outcomes": {o.value: sum(1 for r in records if r.outcome is o) for o in OUTCOMES},
        "ttft_s": _summary(summarize(ttft)),
        "itl_s": _summary(summarize(itl)),
        "e2e_s": _summary(summarize(e2e)),
        "throughput_rps": round(len(ok) / window, 4),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / window, 2),
        "weighted_tokens": sum(r.weighted_tokens for r in records),
        "slo": None,
        "goodput_rps": None,
        "slo_attainment": None,
    }
    if slo is not None:
        g = goodput(records, slo, window)
        report["slo"] = {"ttft_s": slo.ttft_s, "e2e_s": slo.e2e_s}
        report["goodput_rps"] = round(g.rps, 4)
        report["slo_attainment"] = round(g.attainment, 4)
    return report


def _summary(s: Summary | None) -> dict[str, Any] | None:
    return None if s is None else s.to_json()


def run_report(
    result: RunResult,
    slos: Mapping[str, Slo],
    tier_order: Sequence[str],
    peers: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The summary of one run (proxy or direct), as stored in results.json. ``peers`` maps a
    tenant to its group of equal demand (Scenario.peers()): the TTFT spread inside each group
    is reported as latency fairness."""
    records = result.records
    window = makespan(records) or result.planned_duration
    by_tier: dict[str, list[RequestRecord]] = defaultdict(list)
    by_tenant: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        by_tier[r.tier].append(r)
        by_tenant[r.tenant].append(r)
    tiers = [t for t in tier_order if t in by_tier] + sorted(set(by_tier) - set(tier_order))
    tenant_tier = {r.tenant: r.tier for r in records}
    fairness: dict[str, Any] = {}
    for tier in tiers:
        tenants = {r.tenant for r in by_tier[tier]}
        if len(tenants) < 2:
            continue
        f = backlogged_fairness(by_tier[tier])
        fairness[tier] = {
            "jain": None if f.index is None else round(f.index, 4),
            "weighted_tokens_per_s": {t: round(v, 1) for t, v in f.rates.items()},
            "backlogged_s": f.backlogged_s,
        }
    queue_metrics = any(s.queue_depth for s in result.samples)
    return {
        "label": result.label,
        "base_url": result.base_url,
        "window_s": round(window, 3),
        "wall_s": round(result.wall_s, 3),
        "queue_depth_source": "proxy /metrics" if queue_metrics else "client in-flight",
        "total": group_report(records, window, None),
        "tiers": {t: group_report(by_tier[t], window, slos.get(t)) for t in tiers},
        "tenants": {
            name: {
                "tier": tenant_tier[name],
                **group_report(rs, window, slos.get(tenant_tier[name])),
            }
            for name, rs in sorted(
                by_tenant.items(), key=lambda kv: (tiers.index(tenant_tier[kv[0]]), kv[0])
            )
        },
        "fairness": fairness,
        "latency_fairness": latency_fairness(by_tenant, peers or {}),
    }


def latency_fairness(
    by_tenant: Mapping[str, Sequence[RequestRecord]], peers: Mapping[str, str]
) -> dict[str, Any]:
    """Per group of equal-demand tenants: each one's TTFT p50 / p99 (ok requests) and the
    max/min ratio of each (1.0: all served alike)."""
    groups: dict[str, dict[str, list[float]]] = defaultdict(dict)
    for tenant, records in by_tenant.items():
        if tenant in peers:
            ok = [r.ttft for r in records if r.outcome is Outcome.OK and r.ttft is not None]
            groups[peers[tenant]][tenant] = ok
    out: dict[str, Any] = {}
    for group, ttfts in sorted(groups.items()):
        spread = latency_spread(ttfts)
        if spread is None:
            continue
        out[group] = {
            "ttft_p50_s": {t: round(v, 4) for t, v in spread.p50.items()},
            "ttft_p99_s": {t: round(v, 4) for t, v in spread.p99.items()},
            "p50_ratio": round(spread.p50_ratio, 3),
            "p99_ratio": round(spread.p99_ratio, 3),
        }
    return out


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"


def _pick(report: Mapping[str, Any], metric: str, stat: str) -> float | None:
    summary = report.get(metric)
    return None if summary is None else float(summary[stat])


_HEAD = (
    f"{'':<16}{'reqs':>6}{'ok':>6}{'429':>5}{'503':>5}{'504':>5}{'err':>5}{'lost':>5}"
    f" | {'TTFT p50':>8}{'p90':>7}{'p99':>7}{'max':>7}"
    f" | {'ITL p50':>7}{'p99':>7} | {'e2e p50':>7}{'p99':>7}"
    f" | {'req/s':>6}{'tok/s':>7} | {'good/s':>6}{'SLO%':>5}"
)


def _row(name: str, g: Mapping[str, Any]) -> str:
    o = g["outcomes"]
    slo = g.get("slo_attainment")
    return (
        f"{name[:16]:<16}{g['requests']:>6}{o['ok']:>6}{o['429']:>5}{o['503']:>5}{o['504']:>5}"
        f"{o['error']:>5}{o['lost']:>5}"
        f" | {_fmt(_pick(g, 'ttft_s', 'p50')):>8}{_fmt(_pick(g, 'ttft_s', 'p90')):>7}"
        f"{_fmt(_pick(g, 'ttft_s', 'p99')):>7}{_fmt(_pick(g, 'ttft_s', 'max')):>7}"
        f" | {_fmt(_pick(g, 'itl_s', 'p50')):>7}{_fmt(_pick(g, 'itl_s', 'p99')):>7}"
        f" | {_fmt(_pick(g, 'e2e_s', 'p50')):>7}{_fmt(_pick(g, 'e2e_s', 'p99')):>7}"
        f" | {g['throughput_rps']:>6.2f}{g['output_tokens_per_s']:>7.0f}"
        f" | {_fmt(g.get('goodput_rps')):>6}{'-' if slo is None else f'{100 * slo:.0f}':>5}"
    )


def render_run(report: Mapping[str, Any]) -> str:
    lines = [
        f"== {report['label']}  {report['base_url']}  window {report['window_s']:.1f}s"
        "  (latencies in seconds, from the scheduled send time)",
        _HEAD,
    ]
    for tier, g in report["tiers"].items():
        lines.append(_row(f"tier {tier}", g))
    lines.append(_row("all", report["total"]))
    lines.append("")
    for tenant, g in report["tenants"].items():
        lines.append(_row(f"  {tenant}", g))
    for tier, f in report["fairness"].items():
        rates = ", ".join(f"{t} {v:.0f}" for t, v in f["weighted_tokens_per_s"].items())
        jain = "-" if f["jain"] is None else f"{f['jain']:.3f}"
        lines.append(f"fairness {tier}: Jain {jain} (weighted tokens/s while backlogged: {rates})")
    for spread in report.get("latency_fairness", {}).values():
        p50 = " / ".join(f"{v:.2f}" for v in spread["ttft_p50_s"].values())
        p99 = " / ".join(f"{v:.2f}" for v in spread["ttft_p99_s"].values())
        lines.append(
            f"latency fairness ({', '.join(spread['ttft_p50_s'])}): TTFT p50 {p50} s"
            f" (max/min {spread['p50_ratio']:.2f}), p99 {p99} s (max/min {spread['p99_ratio']:.2f})"
        )
    return "\n".join(lines)


def comparison(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """The headline numbers of each run side by side: {metric: {label: value}}."""
    rows: dict[str, dict[str, float | None]] = {}
    for label, rep in reports.items():
        for tier, g in rep["tiers"].items():
            for stat in ("p50", "p99"):
                key = f"{tier} TTFT {stat} (s)"
                rows.setdefault(key, {})[label] = _pick(g, "ttft_s", stat)
            rows.setdefault(f"{tier} e2e p99 (s)", {})[label] = _pick(g, "e2e_s", "p99")
            if g.get("slo_attainment") is not None:
                rows.setdefault(f"{tier} within SLO (%)", {})[label] = 100 * g["slo_attainment"]
        total = rep["total"]
        rows.setdefault("total output tokens/s", {})[label] = total["output_tokens_per_s"]
        rows.setdefault("total ok requests/s", {})[label] = total["throughput_rps"]
        for tier, f in rep["fairness"].items():
            rows.setdefault(f"{tier} fairness (Jain)", {})[label] = f["jain"]
        for group, spread in rep.get("latency_fairness", {}).items():
            rows.setdefault(f"{group} peers TTFT p50 max/min", {})[label] = spread["p50_ratio"]
        for outcome in ("429", "503", "504", "error", "lost"):
            rows.setdefault(f"{outcome} count", {})[label] = total["outcomes"][outcome]
    return rows


def render_comparison(rows: Mapping[str, Mapping[str, float | None]], labels: Sequence[str]) -> str:
    lines = ["== side by side", f"{'':<28}" + "".join(f"{label:>10}" for label in labels)]
    for metric, values in rows.items():
        cells = "".join(f"{_fmt(values.get(label)):>10}" for label in labels)
        lines.append(f"{metric:<28}{cells}")
    return "\n".join(lines)
