"""The Grafana dashboard in the repo: provisioned by docker-compose next to Prometheus, and
every proxy metric a panel queries is on a live proxy's /metrics (vLLM's names are checked
against a real vLLM in tests/integration/test_live_view.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from aiohttp.test_utils import TestClient, TestServer

from proxy.api.outcome import Outcome
from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import SECRET, make_config
from proxy.config.loader import parse_config
from proxy.config.tenants import hash_key
from proxy.server.app import create_app
from tests.helpers.clock import FakeClock
from tests.helpers.dashboard import (
    DASHBOARD,
    REFUSAL_OUTCOMES,
    exposed_names,
    panels,
    queried_names,
)
from tests.helpers.paths import REPO


async def test_every_proxy_metric_a_panel_queries_is_on_metrics(
    clock: FakeClock, tmp_path: Path
) -> None:
    async with FakeVLLM().serve() as url:
        config = make_config(
            [{"url": url}],
            usage_log={"path": str(tmp_path / "u.jsonl")},
            admin_keys=[{"sha256": hash_key("admin")}],
        )
        app = create_app(parse_config(yaml.safe_dump(config)), secret=SECRET, clock=clock)
        admin = {"Authorization": "Bearer admin"}
        async with (
            TestClient(TestServer(app)) as client,
            client.get("/metrics", headers=admin) as resp,
        ):
            exposed = exposed_names(await resp.text())
    wanted = {n for n in queried_names() if n.startswith("tierproxy_")}
    assert len(wanted) >= 14
    assert wanted <= exposed, f"not on /metrics: {sorted(wanted - exposed)}"
    assert {n for n in queried_names() if n.startswith("vllm:")}  # checked live elsewhere


def test_panels_cover_tiers_tenants_backends_and_vllm() -> None:
    exprs = " ".join(t["expr"] for p in panels() for t in p["targets"])
    for needed in (
        "tierproxy_time_to_first_token_seconds_bucket",
        "tierproxy_queue_wait_seconds_bucket",
        "tierproxy_queue_depth",
        "tierproxy_requests_total{outcome=~",
        "tierproxy_usage_tokens_total",
        "tierproxy_rate_limited_total",
        "tierproxy_backend_free_slots",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert needed in exprs
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids))


def test_the_adapters_row_shows_every_adapter_metric_by_adapter() -> None:
    """Requests, tokens, loads, unloads, load latency and load failures per adapter (issue 34),
    in the panels under the "LoRA adapters" row, each split by its adapter label."""
    data = json.loads(DASHBOARD.read_text())
    (row,) = [p for p in data["panels"] if p["type"] == "row" and "adapters" in p["title"]]
    below = [p for p in panels() if p["gridPos"]["y"] > row["gridPos"]["y"]]
    targets = [t for p in below for t in p["targets"]]
    exprs = " ".join(t["expr"] for t in targets)
    for family in (
        "tierproxy_adapter_requests_total",
        "tierproxy_adapter_tokens_total",
        "tierproxy_adapter_loads_total",
        "tierproxy_adapter_unloads_total",
        "tierproxy_adapter_load_seconds_bucket",
        "tierproxy_adapter_load_failures_total",
    ):
        assert family in exprs, family
    for target in targets:
        assert re.search(r"by \([^)]*\badapter\b", target["expr"]), target["expr"]
        assert "{{adapter}}" in target["legendFormat"], target
    assert all(p["gridPos"]["y"] > row["gridPos"]["y"] for p in below)
    assert not [p for p in panels() if "adapter" in p["title"].lower() and p not in below]


def test_refusals_are_refusal_outcomes_only() -> None:
    """Panel 5 plots what the proxy refused, never a client that left nor a request served."""
    (refusals,) = [p for p in panels() if p["title"].startswith("Refusals")]
    (target,) = refusals["targets"]
    matched = re.search(r'outcome=~"([^"]+)"', target["expr"])
    assert matched is not None, target["expr"]
    plotted = {o for o in Outcome if re.fullmatch(matched.group(1), o.value)}
    refused = {o for o in Outcome if o.value in REFUSAL_OUTCOMES}
    assert plotted == refused
    assert Outcome.CLIENT_GONE not in plotted and Outcome.OK not in plotted


def test_rates_of_seconds_are_not_drawn_as_seconds() -> None:
    """A rate of seconds per second is a mean number in progress, not a duration."""
    for panel in panels():
        for target in panel["targets"]:
            if re.search(r"rate\(\w+_seconds_total", target["expr"]):
                assert panel["fieldConfig"]["defaults"]["unit"] in ("short", "none"), panel["title"]
                assert "mean" in panel["title"], panel["title"]


def test_compose_provisions_grafana_with_the_dashboard() -> None:
    services: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    grafana = services["grafana"]
    assert "prometheus" in grafana["depends_on"]
    mounts = {}
    for volume in grafana["volumes"]:
        source, target, _mode = volume.split(":")
        mounts[target] = source
    provisioning = REPO / mounts["/etc/grafana/provisioning"]
    dashboards_dir = mounts["/var/lib/grafana/dashboards"]
    assert (REPO / dashboards_dir / "tierproxy.json").exists()
    provider = yaml.safe_load((provisioning / "dashboards" / "tierproxy.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (ds,) = source["datasources"]
    assert ds["url"] == "http://prometheus:9090" and "prometheus" in services
    assert {t["datasource"]["uid"] for p in panels() for t in p["targets"]} == {ds["uid"]}
