"""The Helm chart (deploy/helm/tierproxy) renders and lints as `helm template`/`helm lint` do,
over its default values and each example; every object it renders is valid for a current
Kubernetes; the proxy's config it renders loads as the proxy loads it; broken values fail.

Helm is Helm's own Go library (helm-python-sdk, in-process): no helm binary can be had on this
machine (no Debian package, no download). No cluster runs here: nothing is installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config.loader import load_config
from tests.helpers.paths import REPO

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's library) not installed")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

CHART = REPO / "deploy" / "helm" / "tierproxy"
KUBERNETES = "1.37.0"  # the newest release kubernetes-validate knows
VALUES = {
    "default": None,
    **{p.stem: p for p in sorted((CHART / "examples").glob("*.yaml"))},
}


def render(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    manifests = helm.Chart.load(str(CHART)).render(
        values, name="tp", namespace="llm", is_install=True
    )
    return [
        doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc is not None
    ]


def values_of(name: str) -> dict[str, Any] | None:
    path = VALUES[name]
    return None if path is None else yaml.safe_load(path.read_text())


def test_two_examples_beside_the_defaults() -> None:
    assert len(VALUES) >= 3


@pytest.mark.parametrize("name", VALUES)
def test_the_chart_lints_clean(name: str) -> None:
    report = helm.lint(str(CHART), values_of(name), strict=True, kube_version=f"v{KUBERNETES}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("name", VALUES)
def test_every_object_is_valid_kubernetes(name: str) -> None:
    objects = render(values_of(name))
    kinds = {obj["kind"] for obj in objects}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    for obj in objects:
        if obj["apiVersion"] == "monitoring.coreos.com/v1":
            # The Prometheus Operator's CRD: no schema offline; its shape is checked here.
            assert obj["kind"] == "ServiceMonitor"
            assert obj["spec"]["selector"] and obj["spec"]["endpoints"]
            continue
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


@pytest.mark.parametrize("name", VALUES)
def test_the_rendered_config_loads_as_the_proxy_loads_it(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = render(values_of(name))
    (configmap,) = (o for o in objects if o["kind"] == "ConfigMap")
    (proxy,) = (
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "tp-tierproxy-proxy"
    )
    path = tmp_path / "config.yaml"
    path.write_text(configmap["data"]["config.yaml"])
    container = proxy["spec"]["template"]["spec"]["containers"][0]
    # The ticket secret's variable comes from the Secret; the tenants' from the keys Secret.
    secret_env = {e["name"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    for var in secret_env:
        monkeypatch.setenv(var, "a-ticket-secret-of-at-least-32-bytes-long")
    for var in ("CHAT_APP_KEY", "BATCH_KEY"):
        monkeypatch.setenv(var, f"generated-{var.lower()}")
    config = load_config(path).config
    assert config.ticket_secret_env in secret_env
    assert config.backends
    # Probes on the proxy's own health routes; the config is mounted as a folder (no subPath),
    # so an edit of the ConfigMap reaches the running proxy, which reloads it.
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    (mount,) = (m for m in container["volumeMounts"] if m["name"] == "config")
    assert "subPath" not in mount
    assert container["args"][-1] == f"{mount['mountPath']}/config.yaml"


def test_engines_have_the_plugin_gpus_and_kv_event_ports() -> None:
    objects = render(None)
    (engines,) = (o for o in objects if o["kind"] == "StatefulSet")
    vllm = engines["spec"]["template"]["spec"]["containers"][0]
    flags = dict(a.removeprefix("--").split("=", 1) for a in vllm["args"] if "=" in a)
    assert flags["middleware"] == "proxy.vllm_plugin.middleware.TicketMiddleware"
    assert flags["scheduler-cls"] == "proxy.vllm_plugin.scheduler.TierScheduler"
    assert flags["scheduling-policy"] == "priority"
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
    assert {"kv-events", "kv-replay"} <= set(ports)
    assert f"tcp://*:{ports['kv-events']}" in flags["kv-events-config"]
    # Shared state: the proxy's config points at the chart's Redis.
    (configmap,) = (o for o in objects if o["kind"] == "ConfigMap")
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    assert config["shared_state"]["url"] == "redis://tp-tierproxy-redis:6379/0"
    assert len(config["backends"]) == engines["spec"]["replicas"]


@pytest.mark.parametrize(
    "broken",
    [
        {"proxy": {"replicas": -1}},
        {"proxy": {"replicas": "two"}},
        {"ticketSecret": {"name": ""}},
        {"ticketSecret": {"name": None}},
        {"engines": {"replicas": 0}},
        {"proxy": {"service": {"port": 70000}}},
    ],
)
def test_broken_values_fail(broken: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render(broken)
