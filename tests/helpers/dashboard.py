"""The metric names the Grafana dashboard queries, and the names a /metrics text can carry:
the tests that keep the dashboard from rotting share these."""

from __future__ import annotations

import json
import re
from typing import Any

from tests.helpers.paths import REPO

DASHBOARD = REPO / "configs" / "grafana" / "dashboards" / "tierproxy.json"
# What the proxy refused (429 and its own 503s): the outcomes the "Refusals" panel plots.
REFUSAL_OUTCOMES = frozenset(
    {"queue_full", "refused_early", "rate_limited", "queue_timeout", "unavailable"}
)
_NAME = re.compile(r"\b(tierproxy_[a-zA-Z0-9_]+|vllm:[a-zA-Z0-9_:]+)")
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gauge": ("",),
}


def panels() -> list[dict[str, Any]]:
    data = json.loads(DASHBOARD.read_text())
    return [p for p in data["panels"] if p["type"] != "row"]


def queried_names() -> set[str]:
    return {m for p in panels() for t in p["targets"] for m in _NAME.findall(t["expr"])}


def exposed_names(text: str) -> set[str]:
    """Every sample name a Prometheus text holds, and those its ``# TYPE`` lines declare (a
    labelled metric shows no sample until its first labels are used)."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            # Counters are declared with or without their _total, by client version.
            base = name.removesuffix("_total") if kind == "counter" else name
            names |= {base + suffix for suffix in _SUFFIXES.get(kind, ("",))}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names
