"""`tierproxy bench` arguments that need no server: listing, config writing, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.bench.cli import main
from proxy.config.loader import load_config


def test_list_scenarios(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list-scenarios"]) == 0
    out = capsys.readouterr().out
    for name in ("seed-mixed", "overload-2x", "fairness", "burst"):
        assert name in out


def test_write_proxy_config_is_a_valid_proxy_config(tmp_path: Path) -> None:
    path = tmp_path / "bench.yaml"
    # A leading "--" (from `tierproxy bench -- ...`) is accepted.
    code = main(
        [
            "--",
            "--scenario",
            "fairness",
            "--write-proxy-config",
            str(path),
            "--backend",
            "http://127.0.0.1:8100",
            "--proxy-port",
            "8123",
        ]
    )
    assert code == 0
    loaded = load_config(path)
    assert loaded.config.listen.port == 8123
    tenant = loaded.tenant_for_key("bench-heavy-key")
    assert tenant is not None and tenant.tier == "normal"


@pytest.mark.parametrize(
    "argv",
    [
        ["--scenario", "fairness"],  # no target at all
        ["--direct", "http://10.1.2.3:8000"],  # not this machine
        ["--target", "ftp://127.0.0.1:8000"],
        ["--local", "--direct", "http://127.0.0.1:8100"],
        ["--scenario", "no-such-scenario", "--direct", "http://127.0.0.1:8100"],
        ["--write-proxy-config", "x.yaml"],  # no --backend
    ],
)
def test_refusals_exit_1(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1
    assert "tierproxy bench:" in capsys.readouterr().err
