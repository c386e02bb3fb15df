"""docker-compose.yml stays consistent with the code: `docker compose config` where a docker
client with compose exists, and a structural check everywhere."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config.loader import load_config
from proxy.ticket import PLUGIN_FLAGS
from proxy.tools.engine import kv_event_args
from tests.helpers.paths import REPO


def _proxy_config(proxy: dict[str, Any]) -> str:
    """The host path of the config the proxy service serves: its folder mount plus the file
    its command names. A folder, not a single-file mount: a file renamed over on the host (a
    safe edit, `tierproxy keys`) never reaches a single-file mount, so no reload would see it."""
    host, container = proxy["volumes"][0].split(":")[:2]
    config = proxy["command"][proxy["command"].index("-c") + 1]
    assert (REPO / host).is_dir(), "mount the config's folder, not the file"
    assert config.startswith(container.rstrip("/") + "/")
    return str(Path(host) / config[len(container.rstrip("/")) + 1 :])


def _compose() -> dict[str, Any]:
    data = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


def _compose_cli() -> list[str] | None:
    """`docker compose` (v2) where it runs, else Debian's `docker-compose` (v1.29), else None."""
    if shutil.which("docker") is not None:
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def test_compose_structure_matches_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    services = _compose()["services"]
    assert {"proxy", "proxy-2", "redis", "haproxy", "vllm-0", "vllm-1", "prometheus"} <= set(
        services
    )
    for name in ("vllm-0", "vllm-1"):
        svc = services[name]
        args = dict((*a.removeprefix("--").split("=", 1), "")[:2] for a in svc["command"])
        # The KV-event flags are the ones `tierproxy up` passes (port 5557 of each container).
        kv = kv_event_args(5557, int(args["block-size"]), 5558)
        assert [a for a in svc["command"] if a.split("=", 1)[0] in kv] == [
            f"{a}={kv[i + 1]}" if i + 1 < len(kv) and not kv[i + 1].startswith("--") else a
            for i, a in enumerate(kv)
            if a.startswith("--")
        ]
        # YAML cannot import Python: the flags that load the plugin are ticket.PLUGIN_FLAGS.
        wanted = dict(zip(PLUGIN_FLAGS[::2], PLUGIN_FLAGS[1::2], strict=True))
        assert {f"--{k}": v for k, v in args.items() if f"--{k}" in wanted} == wanted
        for flag in ("middleware", "scheduler-cls"):
            module, _, cls = args[flag].rpartition(".")
            # The named class exists (importing needs vllm, which the engine extra brings).
            source = (REPO / (module.replace(".", "/") + ".py")).read_text()
            assert f"class {cls}(" in source or f"class {cls}:" in source
        assert svc["healthcheck"]["test"]
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        assert (REPO / svc["build"]["dockerfile"]).exists()
        assert svc["env_file"] == ".env"

    proxy = services["proxy"]
    assert (REPO / proxy["build"]["dockerfile"]).exists()
    assert proxy["depends_on"]["vllm-0"]["condition"] == "service_healthy"
    host_config = _proxy_config(proxy)
    # The mounted config is valid and points at the compose services.
    env = (REPO / "configs/tierproxy.env.example").read_text().splitlines()
    for line in env:
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            monkeypatch.setenv(key, _as_a_user_sets_it(key, value))
    loaded = load_config(REPO / host_config)
    assert {b.url for b in loaded.config.backends} == {"http://vllm-0:8000", "http://vllm-1:8000"}
    cfg = loaded.config
    assert cfg.listen.host == "0.0.0.0"
    # /metrics and /admin live on their own listener, published on the host's loopback only.
    assert cfg.admin_listen is not None
    admin_port = cfg.admin_listen.port
    # Clients come through haproxy; each replica publishes only its admin port, on loopback.
    assert f"{cfg.listen.port}:{cfg.listen.port}" in services["haproxy"]["ports"]
    assert f"127.0.0.1:{admin_port}:{admin_port}" in proxy["ports"]
    for replica in (proxy, services["proxy-2"]):
        assert all(p.startswith("127.0.0.1:") for p in replica["ports"])
        assert all(p.endswith(f":{admin_port}") for p in replica["ports"])

    # Prometheus and Grafana hold every tenant's usage: the host's loopback only.
    for name in ("prometheus", "grafana"):
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"]), name
    prom = yaml.safe_load((REPO / "configs/prometheus.yml").read_text())
    targets = {
        t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    assert targets == {
        f"proxy:{admin_port}",
        f"proxy-2:{admin_port}",
        "vllm-0:8000",
        "vllm-1:8000",
    }


def test_compose_replicas_share_state_behind_haproxy(monkeypatch: pytest.MonkeyPatch) -> None:
    services = _compose()["services"]
    proxy, second = services["proxy"], services["proxy-2"]
    # The second replica is the first one (same image, command, config), another admin port.
    for key in ("image", "command", "volumes", "env_file", "depends_on", "healthcheck"):
        assert second[key] == proxy[key]
    assert proxy["depends_on"]["redis"]["condition"] == "service_healthy"
    # Official images, as published on Docker Hub.
    assert services["redis"]["image"].startswith("redis:")
    assert services["haproxy"]["image"].startswith("haproxy:")
    mount = services["haproxy"]["volumes"][0].split(":")
    assert mount[1] == "/usr/local/etc/haproxy/haproxy.cfg"
    haproxy = (REPO / mount[0]).read_text()
    assert "mode tcp" in haproxy  # L4: streams pass through untouched
    servers = {
        line.split()[2] for line in haproxy.splitlines() if line.strip().startswith("server ")
    }
    for line in (REPO / "configs/tierproxy.env.example").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            monkeypatch.setenv(key, _as_a_user_sets_it(key, value))
    loaded = load_config(REPO / _proxy_config(proxy))
    port = loaded.config.listen.port
    assert servers == {f"proxy:{port}", f"proxy-2:{port}"}
    assert "option httpchk GET /readyz" in haproxy
    shared = loaded.config.shared_state
    assert shared is not None and shared.url.startswith("redis://redis:")


def test_example_config_keeps_metrics_and_admin_on_loopback() -> None:
    admin = load_config(REPO / "configs/example.yaml").config.admin_listen
    assert admin is not None and admin.host == "127.0.0.1"


def test_plugin_classes_named_in_compose_import() -> None:
    pytest.importorskip("vllm", reason="the engine extra is not installed")
    for name in ("vllm-0",):
        for arg in _compose()["services"][name]["command"]:
            if arg.startswith(("--middleware=", "--scheduler-cls=")):
                module, _, cls = arg.split("=", 1)[1].rpartition(".")
                assert hasattr(importlib.import_module(module), cls)


@pytest.mark.skipif(_compose_cli() is None, reason="no docker compose client on this machine")
def test_docker_compose_config_accepts_the_file(tmp_path: Path) -> None:
    # A copy of the project's compose files beside the example .env (env_file: .env).
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    shutil.copytree(REPO / "docker", tmp_path / "docker")
    shutil.copy(REPO / "docker-compose.yml", tmp_path)
    shutil.copy(REPO / "configs/tierproxy.env.example", tmp_path / ".env")
    result = subprocess.run(
        [*(_compose_cli() or []), "--project-directory", str(tmp_path), "config", "--quiet"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(_compose_cli() is None, reason="no docker compose client on this machine")
def test_the_cpu_test_stack_is_the_gpu_stack_on_cpu() -> None:
    """docker/test/compose.cpu.yml (what `make compose-test` runs) is valid, and its engines
    run with the plugin flags and KV events of docker-compose.yml's, its replicas the same
    image, healthcheck and config mount folder."""
    env = {"TIERPROXY_CONFIG_DIR": "/tmp", "TINY_MODEL_DIR": "/tmp", "TIERPROXY_TICKET_SECRET": "x"}
    test_file = REPO / "docker/test/compose.cpu.yml"
    result = subprocess.run(
        [*(_compose_cli() or []), "-f", str(test_file), "config", "--quiet"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    cpu = yaml.safe_load(test_file.read_text())["services"]
    gpu = _compose()["services"]
    assert set(cpu) == set(gpu) - {"grafana"}
    gpu_flags = {a.split("=", 1)[0] for a in gpu["vllm-0"]["command"]} - {"--model"}
    assert gpu_flags <= {a.split("=", 1)[0] for a in cpu["vllm-0"]["command"]}
    assert cpu["proxy"]["image"] == gpu["proxy"]["image"]
    assert cpu["proxy"]["healthcheck"]["test"] == gpu["proxy"]["healthcheck"]["test"]
    for service in cpu.values():
        assert service["init"] is True  # python as PID 1 would make `down` wait 10 s


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="no haproxy on this machine")
def test_haproxy_accepts_its_config() -> None:
    # Outside Docker the replicas' names do not resolve: init-addr none lets it start anyway.
    result = subprocess.run(
        ["haproxy", "-c", "-f", str(REPO / "configs/haproxy.cfg")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def _as_a_user_sets_it(name: str, value: str) -> str:
    """The example's value, its placeholder keys replaced as the README says (the proxy
    refuses to start with them)."""
    return f"generated-{name.lower()}-value" if name.endswith("_KEY") else value
