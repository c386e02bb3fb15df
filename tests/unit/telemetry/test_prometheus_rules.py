"""The alerting and recording rules in configs/prometheus/: valid for Prometheus (`promtool check
rules`), behaving as their unit tests say (`promtool test rules`, configs/prometheus/tests/),
written on metric names the proxy (or its vLLM plugin) really exports, documented in
docs/alerts.md, and loaded by docker-compose.yml's Prometheus."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.bench.inproc import SECRET, make_config
from proxy.config.loader import parse_config
from proxy.server.state import ProxyState
from tests.helpers import promserver
from tests.helpers.clock import FakeClock
from tests.helpers.paths import REPO

RULES_DIR = REPO / "configs" / "prometheus"
RULE_FILES = sorted(RULES_DIR.glob("*.yml"))
RULE_TESTS = sorted((RULES_DIR / "tests").glob("*.yml"))
_DECLARED = re.compile(r'"(tierproxy_[a-z_]+)"')
_USED = re.compile(r"\b(tierproxy_[a-z_]+)\b")
_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count")

needs_promtool = pytest.mark.skipif(not promserver.available(), reason=promserver.MISSING)


def promtool(*args: str, cwd: Path = REPO) -> str:
    done = subprocess.run(
        ["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    return out


def rules() -> list[dict[str, Any]]:
    found = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            found += group["rules"]
    return found


@needs_promtool
def test_the_rules_are_valid_for_prometheus() -> None:
    assert RULE_FILES, "no rule files in configs/prometheus/"
    out = promtool("check", "rules", *map(str, RULE_FILES))
    assert f"SUCCESS: {len(rules())} rules found" in out
    promtool("check", "config", "configs/prometheus.yml")


@needs_promtool
@pytest.mark.parametrize("test_file", RULE_TESTS, ids=lambda p: p.name)
def test_the_rules_pass_their_unit_tests(test_file: Path) -> None:
    out = promtool("test", "rules", test_file.name, cwd=test_file.parent)
    assert "SUCCESS" in out


def test_every_alert_is_unit_tested_and_documented() -> None:
    alerts = {r["alert"] for r in rules() if "alert" in r}
    tested = {
        case["alertname"]
        for path in RULE_TESTS
        for test in yaml.safe_load(path.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")  # seen firing, not only silent
    }
    assert alerts - tested == set(), "alerts no unit test sees firing"
    docs = (REPO / "docs" / "alerts.md").read_text()
    for rule in rules():
        if "alert" in rule:
            assert f"`{rule['alert']}`" in docs, rule["alert"]
            anchor = rule["annotations"]["runbook"].split("#", 1)[1]
            headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", docs, re.M)}
            assert anchor in headings, (rule["alert"], anchor)
            assert rule["labels"]["severity"] in ("page", "ticket")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_rules_query_metrics_the_proxy_exports() -> None:
    declared = {
        name
        for path in (REPO / "proxy").rglob("*.py")
        for name in _DECLARED.findall(path.read_text())
    }
    exported = {name + suffix for name in declared for suffix in _SUFFIXES}
    recorded = {r["record"] for r in rules() if "record" in r}
    for rule in rules():
        expr = re.sub(r"\b[a-z_]+:[a-z_]+:[a-z0-9_]+\b", "", rule["expr"])  # recorded series
        used = set(_USED.findall(expr))
        assert used <= exported, (rule.get("alert") or rule.get("record"), used - exported)
        for name in re.findall(r"\b[a-z_]+:[a-z_]+:[a-z0-9_]+\b", rule["expr"]):
            assert name in recorded, name


def test_compose_loads_the_rules() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    prometheus = compose["services"]["prometheus"]
    mounts = dict(v.split(":")[:2] for v in prometheus["volumes"])
    host_config = REPO / next(h for h, c in mounts.items() if c == "/etc/prometheus/prometheus.yml")
    loaded = yaml.safe_load(host_config.read_text())
    patterns = loaded["rule_files"]
    # Every pattern lies in a mounted folder, and the repo's rule files are what they match.
    matched: set[Path] = set()
    for pattern in patterns:
        folder, _, glob = pattern.rpartition("/")
        hosts = [h for h, c in mounts.items() if c == folder]
        assert hosts, f"{pattern}: no volume mounts {folder}"
        matched |= set((REPO / hosts[0]).glob(glob))
    assert matched == set(RULE_FILES)


async def test_what_the_alerts_measure_against_is_on_metrics_and_follows_reloads(
    clock: FakeClock,
) -> None:
    """``tierproxy_queue_max`` (TierproxyQueueNearCap) and ``tierproxy_slo_objective`` (the SLO
    burn alerts' budget) come from the live config: a reload changes them."""
    config = make_config(
        [{"url": "http://127.0.0.1:9"}],
        tiers={"normal": {"max_queue": 40, "slo": {"ttft_s": 1.0, "percentile": 99.5}}},
    )
    rig_state = ProxyState(parse_config(yaml.safe_dump(config), "test"), SECRET, clock)
    registry = rig_state.metrics.registry

    def value(name: str, tier: str) -> float | None:
        return registry.get_sample_value(name, {"tier": tier})

    assert value("tierproxy_queue_max", "normal") == 40
    assert value("tierproxy_queue_max", "low") == 500
    assert value("tierproxy_slo_objective", "normal") == pytest.approx(0.995)
    assert value("tierproxy_slo_objective", "high") is None  # no slo: no budget to burn
    config["tiers"]["high"]["slo"] = {"ttft_s": 0.5, "percentile": 90}
    config["tiers"]["normal"]["max_queue"] = 10
    rig_state.apply(parse_config(yaml.safe_dump(config), "reloaded"))
    assert value("tierproxy_queue_max", "normal") == 10
    assert value("tierproxy_slo_objective", "high") == pytest.approx(0.9)
