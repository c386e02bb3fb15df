"""A proxy config that holds a scenario's tenants and keys, so the proxy knows every tenant.

`tierproxy bench --scenario S --write-proxy-config FILE --backend URL` writes it;
`tierproxy serve -c FILE` runs the proxy on it. Keys go in as sha256 only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from proxy.bench.scenario import Scenario
from proxy.config.loader import parse_config
from proxy.config.schema import LoadedConfig
from proxy.config.tenants import hash_key

# Like configs/example.yaml, with waits and run times short enough that a benchmark run ends:
# a request is answered, rejected or timed out within queue_timeout_s + request_timeout_s.
DEFAULT_TIERS: dict[str, dict[str, Any]] = {
    "high": {
        "priority": 0,
        "weight": 10,
        "max_queue": 200,
        "queue_timeout_s": 10,
        "request_timeout_s": 60,
    },
    "normal": {
        "priority": 5,
        "weight": 5,
        "max_queue": 1000,
        "queue_timeout_s": 30,
        "request_timeout_s": 60,
    },
    "low": {
        "priority": 10,
        "weight": 1,
        "max_queue": 5000,
        "queue_timeout_s": 60,
        "request_timeout_s": 60,
        "max_tokens": 2048,
    },
}
_FALLBACK_TIER: dict[str, Any] = {
    "priority": 10,
    "weight": 1,
    "max_queue": 1000,
    "queue_timeout_s": 30,
    "request_timeout_s": 60,
}


# Bench-only, like the scenario's tenant keys: the key the bench scrapes the proxy's /metrics with.
BENCH_ADMIN_KEY = "bench-admin-key"


def proxy_config(
    scenario: Scenario,
    backends: list[str],
    *,
    port: int = 8000,
    max_inflight: int | None = 4,
    early_refusal: bool = False,
) -> dict[str, Any]:
    """The config as a plain mapping (validated by proxy.config.schema before it is returned).
    ``max_inflight`` None: the backends' room adapts. The scenario's SLOs become the tiers'
    ``slo:``, so the proxy's goodput metrics and its room judge by the bench's numbers."""
    if not backends:
        raise ValueError("a proxy config needs at least one backend URL")
    tiers = {name: dict(t) for name, t in (scenario.proxy_tiers or {}).items()}
    for tier in scenario.tiers:
        tiers.setdefault(tier, dict(DEFAULT_TIERS.get(tier, _FALLBACK_TIER)))
    for tier, spec in scenario.slo.items():
        tiers[tier].setdefault("slo", spec.proxy_slo())
    if early_refusal:
        for settings in tiers.values():
            settings["early_refusal"] = True
    room = {} if max_inflight is None else {"max_inflight": max_inflight}
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "tiers": tiers,
        "tenants": [
            {"name": t.name, "tier": t.tier, "keys": [{"sha256": hash_key(t.api_key)}]}
            for t in scenario.tenants
        ],
        "backends": [{"url": url, **room} for url in backends],
        # /metrics on the client listener needs an admin key: the bench's scrape sends this one.
        "admin_keys": [{"sha256": hash_key(BENCH_ADMIN_KEY)}],
    }
    validate(data)
    return data


def validate(data: dict[str, Any]) -> LoadedConfig:
    """Raises proxy.config.schema.ConfigError when the proxy would refuse this config."""
    return parse_config(yaml.safe_dump(data, sort_keys=False), source="<bench proxy config>")


def write_proxy_config(data: dict[str, Any], path: Path, scenario: Scenario) -> Path:
    header = (
        f"# Proxy config for the bench scenario {scenario.name!r}, written by `tierproxy bench`.\n"
        "# Tenant keys (bench-only): "
        + ", ".join(f"{t.name}={t.api_key}" for t in scenario.tenants)
        + f"; admin (for /metrics): {BENCH_ADMIN_KEY}\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path
