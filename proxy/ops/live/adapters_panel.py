"""``tierproxy top``'s adapters panel: one row per LoRA adapter out of the proxy's own /metrics
text (proxy.telemetry.adapter_metrics), totals since the proxy started. ``/admin/status`` says
nothing per adapter; the metrics already do, and Prometheus reads the same numbers."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rich.table import Table
from rich.text import Text

from proxy.ops.live.window import histogram_quantile
from proxy.telemetry.prometheus import Sample, samples

_PREFIX = "tierproxy_adapter_"


@dataclass
class AdapterRow:
    adapter: str
    requests: float = 0.0
    not_ok: float = 0.0  # finished with any outcome but ok (refusals included)
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    loads: float = 0.0  # over every backend
    unloads: float = 0.0
    load_failures: float = 0.0
    load_seconds_sum: float = 0.0
    load_seconds_count: float = 0.0
    load_buckets: dict[float, float] | None = None  # le -> cumulative count

    @property
    def load_mean_s(self) -> float | None:
        n = self.load_seconds_count
        return self.load_seconds_sum / n if n else None

    @property
    def load_p95_s(self) -> float | None:
        return histogram_quantile(0.95, (self.load_buckets or {}).items())


def adapter_rows(metrics_text: str) -> list[AdapterRow]:
    """Every adapter the proxy's metrics name, by name."""
    rows: dict[str, AdapterRow] = {}
    for s in samples(metrics_text, _PREFIX):
        name = s.labels.get("adapter")
        if name is None:
            continue
        row = rows.setdefault(name, AdapterRow(name))
        _add(row, s)
    return [rows[name] for name in sorted(rows)]


def _add(row: AdapterRow, s: Sample) -> None:
    metric = s.name.removeprefix(_PREFIX)
    if metric == "requests_total":
        row.requests += s.value
        if s.labels.get("outcome") != "ok":
            row.not_ok += s.value
    elif metric == "tokens_total":
        if s.labels.get("kind") == "prompt":
            row.prompt_tokens += s.value
        elif s.labels.get("kind") == "output":
            row.output_tokens += s.value
    elif metric == "loads_total":
        row.loads += s.value
    elif metric == "unloads_total":
        row.unloads += s.value
    elif metric == "load_failures_total":
        row.load_failures += s.value
    elif metric == "load_seconds_sum":
        row.load_seconds_sum += s.value
    elif metric == "load_seconds_count":
        row.load_seconds_count += s.value
    elif metric == "load_seconds_bucket" and "le" in s.labels:
        buckets = row.load_buckets if row.load_buckets is not None else {}
        le = float(s.labels["le"])
        buckets[le] = buckets.get(le, 0.0) + s.value
        row.load_buckets = buckets


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def adapter_table(rows: Iterable[AdapterRow]) -> Table:
    t = Table(title="adapters (since the proxy started)", title_justify="left", expand=True)
    t.add_column("adapter")
    for col in ("requests", "not ok", "prompt tok", "output tok", "loads", "unloads"):
        t.add_column(col, justify="right")
    for col in ("load failed", "load ms mean", "load ms p95"):
        t.add_column(col, justify="right")
    for row in rows:
        failed = Text(f"{row.load_failures:g}", style="bold red" if row.load_failures else "")
        t.add_row(
            row.adapter,
            f"{row.requests:g}",
            f"{row.not_ok:g}",
            f"{row.prompt_tokens:g}",
            f"{row.output_tokens:g}",
            f"{row.loads:g}",
            f"{row.unloads:g}",
            failed,
            _ms(row.load_mean_s),
            _ms(row.load_p95_s),
        )
    return t
