import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config.loader import ConfigError, load_config, parse_config
from proxy.config.tenants import hash_key
from proxy.config.yaml_load import safe_load
from tests.helpers.paths import REPO

GOOD = """
listen: {{host: 127.0.0.1, port: 8000}}
tiers:
  high:   {{priority: 0,  weight: 10, max_queue: 200,  queue_timeout_s: 10, request_timeout_s: 300}}
  low:    {{priority: 10, weight: 1,  max_queue: 5000, queue_timeout_s: 600, request_timeout_s: 1800,
           max_tokens: 2048}}
tenants:
  - name: chat-app
    tier: high
    keys: [{{sha256: "{}"}}]
  - name: batch
    tier: low
    keys: [{{env: BATCH_KEY}}]
backends:
  - {{url: "http://127.0.0.1:8100/", max_inflight: 64}}
""".format(hash_key("chat-secret"))


def test_good_config_resolves_keys_to_tenants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCH_KEY", "batch-secret")
    loaded = parse_config(GOOD)
    assert loaded.tenant_for_key("chat-secret").name == "chat-app"  # type: ignore[union-attr]
    assert loaded.tenant_for_key("batch-secret").name == "batch"  # type: ignore[union-attr]
    assert loaded.tenant_for_key("nope") is None
    cfg = loaded.config
    assert cfg.backends[0].url == "http://127.0.0.1:8100"
    assert cfg.prefill_share("high") == 1.0 and cfg.prefill_share("low") == 0.2
    assert cfg.lowest_priority == 10
    # Only hashes are kept.
    assert "batch-secret" not in repr(loaded) and "chat-secret" not in repr(loaded)


def test_every_error_names_field_and_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCH_KEY", raising=False)
    bad = GOOD.replace("weight: 10", "weight: -1").replace("max_queue: 5000", "max_queue: lots")
    with pytest.raises(ConfigError) as exc:
        parse_config(bad, "x.yaml")
    problems = exc.value.problems
    assert any(p.startswith("tiers.high.weight (line 4)") for p in problems), problems
    assert any(p.startswith("tiers.low.max_queue (line 5)") for p in problems), problems


def test_an_infinite_number_is_refused_where_it_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCH_KEY", "batch-secret")
    for value in (".inf", ".nan"):
        with pytest.raises(ConfigError) as exc:
            parse_config(GOOD.replace("weight: 10", f"weight: {value}"), "x.yaml")
        assert any(p.startswith("tiers.high.weight (line 4)") for p in exc.value.problems)


def test_unknown_tier_missing_env_and_bad_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCH_KEY", raising=False)
    with pytest.raises(ConfigError) as exc:
        parse_config(GOOD.replace("tier: low", "tier: gold"))
    assert "unknown tier 'gold'" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        parse_config(GOOD)
    assert "BATCH_KEY is not set" in str(exc.value) and "line 13" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        parse_config(GOOD.replace(hash_key("chat-secret"), "abc"))
    assert "64 hex" in str(exc.value)


def test_same_key_for_two_tenants_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCH_KEY", "chat-secret")
    with pytest.raises(ConfigError) as exc:
        parse_config(GOOD)
    assert "already belongs to tenant 'chat-app'" in str(exc.value)


def test_unknown_field_and_not_yaml() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(GOOD.replace("listen:", "lisen:"))
    assert "lisen" in str(exc.value)
    with pytest.raises(ConfigError):
        parse_config("tiers: [unclosed")
    with pytest.raises(ConfigError):
        parse_config("- just a list")


def test_example_config_is_valid() -> None:
    loaded = load_config(REPO / "configs" / "example.yaml")
    assert set(loaded.config.tiers) == {"high", "normal", "low"}
    assert loaded.tenant_for_key("demo-high-key").tier == "high"  # type: ignore[union-attr]


def test_cli_check_and_hash_key(tmp_path: Path) -> None:
    exe = [sys.executable, "-m", "proxy.cli"]
    ok = subprocess.run(
        [*exe, "check", "-c", str(REPO / "configs/example.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0 and "tier high: priority 0" in ok.stdout
    broken = tmp_path / "broken.yaml"
    broken.write_text(GOOD.replace("weight: 1,", "weight: 0,"))
    bad = subprocess.run(
        [*exe, "check", "-c", str(broken)],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin"},
    )
    assert bad.returncode == 1
    assert "tiers.low.weight (line 5)" in bad.stderr and "BATCH_KEY" in bad.stderr
    hashed = subprocess.run(
        [*exe, "hash-key"], input="chat-secret\n", capture_output=True, text=True, check=True
    )
    assert hashed.stdout.strip() == hash_key("chat-secret")


def test_policies_section_picks_implementations_and_checks_names() -> None:
    cfg = parse_config(
        GOOD.replace(
            "backends:", "policies: {tiers: strict_priority, order: fcfs}\nbackends:"
        ).replace("{env: BATCH_KEY}", f'{{sha256: "{hash_key("b")}"}}')
    ).config
    assert (cfg.policies.tiers, cfg.policies.tenants, cfg.policies.order) == (
        "strict_priority",
        "vtc",
        "fcfs",
    )
    assert (cfg.policies.displacement, cfg.policies.backends) == ("largest_share", "least_utilised")
    with pytest.raises(ConfigError) as exc:
        parse_config(GOOD.replace("backends:", "policies: {tenants: wfq}\nbackends:"))
    assert any(
        p.startswith("policies.tenants (line 14): Input should be 'vtc' or 'edf'")
        for p in exc.value.problems
    ), exc.value.problems


def test_server_section_defaults_and_admin_listen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCH_KEY", "batch-secret")
    cfg = parse_config(GOOD).config
    assert cfg.admin_listen is None
    server = cfg.server
    assert (server.max_connections, server.header_timeout_s, server.keepalive_timeout_s) == (
        4096,
        10.0,
        15.0,
    )
    tuned = GOOD.replace(
        "backends:",
        "server: {max_connections: 100, keepalive_timeout_s: 5}\n"
        "admin_listen: {port: 9000}\nbackends:",
    )
    cfg = parse_config(tuned).config
    assert cfg.server.max_connections == 100 and cfg.server.keepalive_timeout_s == 5
    assert cfg.admin_listen is not None and cfg.admin_listen.host == "127.0.0.1"
    with pytest.raises(ConfigError) as exc:
        parse_config(tuned.replace("port: 9000", "port: 8000"))
    assert "admin_listen must use another port than listen" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        parse_config(tuned.replace("max_connections: 100", "max_connections: 0"))
    assert "server.max_connections (line 14)" in str(exc.value)


YAML_SAMPLES = [
    "a: 1\nb: [1.5, .inf, -2, 0x1f, 1_000]\nc: {d: null, e: ~, f: yes, g: 'yes', h: \"x\\ty\"}\n",
    "when: 2026-12-01\nstamp: 2026-12-01 10:00:00\nempty:\nblock: |\n  two\n  lines\n",
    "base: &b {x: 1}\nderived: {<<: *b, y: 2}\n",  # anchors and merge keys: the full loader
    "tagged: !!str 123\nset: !!set {a, b}\n",
    "",
    "just a string",
]


@pytest.mark.parametrize("text", YAML_SAMPLES)
def test_fast_yaml_loads_what_safe_load_loads(text: str) -> None:
    assert safe_load(text) == yaml.safe_load(text)


def test_fast_yaml_raises_what_safe_load_raises() -> None:
    for text in (
        "a: [unclosed",
        "a: 1\n---\nb: 2\n",
        "a: *undefined",
        "? [complex, key]\n: value\n",
    ):
        with pytest.raises(yaml.YAMLError):
            yaml.safe_load(text)
        with pytest.raises(yaml.YAMLError):
            safe_load(text)


def test_large_tenant_lists_validate_in_chunks_with_the_same_locations() -> None:
    tenants = "".join(
        f'  - {{name: t{i}, tier: high, keys: [{{sha256: "{hash_key(str(i))}"}}]}}\n'
        for i in range(1200)
    )
    head, backends = GOOD.split("tenants:")[0], GOOD.split("backends:")[1]
    text = f"{head}tenants:\n{tenants}backends:{backends}"
    loaded = parse_config(text)
    assert len(loaded.config.tenants) == 1200 and loaded.tenant_for_key("1199") is not None
    broken = text.replace("name: t700,", "name: t700, weight: 0,").replace("t1100", "t1")
    with pytest.raises(ConfigError) as exc:
        parse_config(broken)
    line = 8 + 700  # tenants: on line 7 of GOOD's head
    assert exc.value.problems[0].startswith(f"tenants.700.weight (line {line}):")
    assert len(exc.value.problems) == 1  # t1 twice: cross-checks run only on valid tenants
    with pytest.raises(ConfigError) as exc:
        parse_config(text.replace("t1100", "t1"))
    assert "tenant name 't1' appears twice" in str(exc.value)


def _check(path: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check", "-c", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def test_check_warns_where_metrics_would_be_readable_without_a_key(tmp_path: Path) -> None:
    """/metrics lists every tenant's usage: `tierproxy check` says when an admin_listen off
    loopback serves it keyless, or when it is not served at all; loopback or keys: quiet."""
    base = yaml.safe_load(REPO.joinpath("configs/example.yaml").read_text())
    cases: dict[str, tuple[dict[str, Any], str | None]] = {
        "open": ({"admin_listen": {"host": "0.0.0.0", "port": 8001}}, "needs no key"),
        "off": ({"admin_listen": None, "admin_keys": []}, "/metrics is not served"),
        "loopback": ({"admin_listen": {"host": "127.0.0.1", "port": 8001}}, None),
        "keyed": ({"admin_listen": None, "admin_keys": [{"sha256": hash_key("a")}]}, None),
    }
    for name, (over, warning) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**base, **over}))
        out = _check(path)
        if warning is None:
            assert "warning" not in out, name
        else:
            assert "warning" in out and warning in out, name
