"""The example keys shipped in configs/tierproxy.env.example are refused at start (and on a
reload), like the example ticket secret: by value where the key comes from the environment, by
hash where the config holds its sha256 (issue 22: `Bearer change-me` answered 200 as the high
tier). The served twin: tests/adversarial/served/test_memory_routes_startup_served.py."""

from __future__ import annotations

import pytest
import yaml

from proxy.bench.inproc import make_config
from proxy.config.loader import ConfigError, parse_config
from proxy.config.tenants import hash_key
from tests.helpers.paths import REPO


def example_keys() -> dict[str, str]:
    """The *_KEY variables of the shipped env example, and their values."""
    pairs = {}
    for line in (REPO / "configs/tierproxy.env.example").read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.startswith("#") and name.endswith("_KEY"):
            pairs[name] = value
    return pairs


def config_with(spec: dict[str, str], admin: bool = False) -> str:
    tenant = {"name": "t", "tier": "high", "keys": [spec]}
    config = make_config([{"url": "http://127.0.0.1:9"}], tenants=[] if admin else [tenant])
    if admin:
        config["admin_keys"] = [spec]
    return yaml.safe_dump(config)


def test_the_example_has_keys_to_refuse() -> None:
    assert len(example_keys()) >= 2


@pytest.mark.parametrize("admin", [False, True], ids=["tenant", "admin"])
def test_every_example_key_is_refused_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, admin: bool
) -> None:
    for name, value in example_keys().items():
        monkeypatch.setenv(name, value)
        with pytest.raises(ConfigError) as exc:
            parse_config(config_with({"env": name}, admin))
        assert "placeholder" in str(exc.value) and value not in str(exc.value)
        monkeypatch.setenv(name, f"  {value.upper()}  ")  # the same placeholder, dressed up
        with pytest.raises(ConfigError):
            parse_config(config_with({"env": name}, admin))


def test_every_example_key_is_refused_by_its_hash() -> None:
    for value in example_keys().values():
        with pytest.raises(ConfigError) as exc:
            parse_config(config_with({"sha256": hash_key(value)}))
        assert "placeholder" in str(exc.value)


def test_a_generated_key_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHAT_APP_KEY", "k3y-generated-for-this-deployment")
    loaded = parse_config(config_with({"env": "CHAT_APP_KEY"}))
    assert loaded.tenant_for_key("k3y-generated-for-this-deployment") is not None
