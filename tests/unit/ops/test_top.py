"""``tierproxy top``'s screen from a status (and its adapters panel from a /metrics text), and
the view itself in a tmux terminal against an in-process proxy: a wrong key shows the proxy's
answer, q quits."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import SECRET, make_config, serve_app
from proxy.config.loader import parse_config
from proxy.config.tenants import hash_key
from proxy.ops.live.top import StatusError, fetch_metrics, render
from proxy.server.app import create_app
from proxy.telemetry.adapter_metrics import AdapterMetrics
from tests.helpers.paths import REPO

STATUS: dict[str, Any] = {
    "window_s": 42.0,
    "tiers": [
        {"name": "high", "priority": 0, "depth": 3, "max_queue": 200, "limit_waiting": 1,
         "running": 4, "wait_p99_s": 0.25, "finished": 17, "refused": {"queue_full": 2},
         "tokens_per_s": 812.5},
    ],
    "tenants": [
        {"name": "acme", "tier": "high", "queued": 3, "running": 4, "tokens_per_s": 812.5,
         "share": 0.75, "fair_share": 0.5, "limits_hit": {"tokens_per_minute": 5}},
    ],
    "tenants_active": 7,
    "backends": [
        {"name": "gpu-0", "state": "ramping", "room": 1.5, "inflight": 4, "max_inflight": 8,
         "vllm_running": 4.0, "vllm_waiting": 1.0, "vllm_kv_usage": 0.375,
         "metrics_age_s": 0.4},
    ],
}  # fmt: skip


def _text(renderable: Any) -> str:
    console = Console(width=200, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def test_the_screen_shows_every_number_of_the_status() -> None:
    screen = _text(render(STATUS, "http://proxy:8001"))
    rows = {line.split("│")[1].strip(): line for line in screen.splitlines() if "│" in line}
    assert all(x in rows["high"] for x in ("3/200", "0.250", "812.5", "17", "queue_full=2"))
    acme = rows["acme"]
    assert all(x in acme for x in ("75%", "50%", "tokens_per_minute=5"))
    assert all(x in rows["gpu-0"] for x in ("ramping", "1.5", "4/8", "37.5%", "0.4"))
    assert "tenants (7 active, 1 shown)" in screen and "window 42s" in screen
    down = _text(render(None, "http://proxy:8001", "cannot read http://proxy:8001/admin/status"))
    assert "cannot read" in down and "no data" in down


def _adapter_metrics_text() -> str:
    """What the proxy's /metrics says after two adapters' traffic (its own exporter)."""
    registry = CollectorRegistry()
    metrics = AdapterMetrics(registry)
    for seconds in (0.02, 0.04):
        metrics.loaded("http://e0:8000", "lora-a", seconds)
    metrics.loaded("http://e1:8000", "lora-a", 0.03)
    metrics.unloaded("http://e0:8000", "lora-a")
    metrics.failed("http://e1:8000", "lora-b", "HTTP 404")
    metrics.failed("http://e1:8000", "lora-b", "timed out")
    for outcome in ("ok", "ok", "ok", "queue_full"):
        metrics.finished("lora-a", outcome, 100, 32)
    metrics.finished("lora-b", "backend_error", 0, 0)
    return generate_latest(registry).decode()


def test_the_adapters_panel_shows_each_adapter_from_the_metrics_text() -> None:
    screen = _text(render(STATUS, "http://proxy:8001", metrics_text=_adapter_metrics_text()))
    assert "adapters (since the proxy started)" in screen
    rows = {line.split("│")[1].strip(): line for line in screen.splitlines() if "│" in line}
    a = rows["lora-a"].split("│")[2:-1]
    # requests, not ok, prompt, output tokens, loads (both engines), unloads, failed, ms mean
    assert [c.strip() for c in a[:8]] == ["4", "1", "400", "128", "3", "1", "0", "30"]
    assert 25 <= float(a[8]) <= 50  # p95 interpolated inside the 25-50 ms bucket
    b = [c.strip() for c in rows["lora-b"].split("│")[2:-1]]
    assert b == ["1", "1", "0", "0", "0", "0", "2", "-", "-"]  # two failed loads, none timed


def test_no_adapters_panel_without_adapters_in_the_metrics() -> None:
    registry = CollectorRegistry()
    AdapterMetrics(registry)  # the families exist, with no adapter yet
    screen = _text(
        render(STATUS, "http://proxy:8001", metrics_text=generate_latest(registry).decode())
    )
    assert "adapters" not in screen and "gpu-0" in screen


async def test_top_reads_the_metrics_with_the_admin_key() -> None:
    async with FakeVLLM().serve() as url:
        config = make_config([{"url": url}], admin_keys=[{"sha256": hash_key("right-key")}])
        app = create_app(parse_config(yaml.safe_dump(config)), secret=SECRET)
        async with serve_app(app) as base:
            text = await asyncio.to_thread(fetch_metrics, base, "right-key")
            assert "tierproxy_adapter_requests" in text  # the panel's families are exported
            with pytest.raises(StatusError, match="401"):
                await asyncio.to_thread(fetch_metrics, base, "wrong-key")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (make test does)")
async def test_top_in_tmux_shows_a_refusal_and_quits_on_q() -> None:
    socket = f"tierproxy-unit-{os.getpid()}"

    async def tmux(*args: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            "tmux", "-L", socket, *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        async with asyncio.timeout(10):
            out, _ = await proc.communicate()
        return proc.returncode or 0, out.decode(errors="replace")

    async with FakeVLLM().serve() as url:
        config = make_config([{"url": url}], admin_keys=[{"sha256": hash_key("right-key")}])
        app = create_app(parse_config(yaml.safe_dump(config)), secret=SECRET)
        async with serve_app(app) as base:
            command = (
                # pytest exports COLUMNS and LINES, which rich would take over the pane's size.
                f"env -u COLUMNS -u LINES TIERPROXY_ADMIN_KEY=wrong-key PYTHONPATH={REPO}"
                f" {sys.executable} -m proxy.cli top --proxy {base}"
            )
            rc, out = await tmux("new-session", "-d", "-s", "top", "-x", "120", "-y", "20", command)
            assert rc == 0, out
            try:
                screen = ""
                for _ in range(200):
                    rc, screen = await tmux("capture-pane", "-p", "-t", "top")
                    if "401" in screen:
                        break
                    await asyncio.sleep(0.05)
                assert "401" in screen and "invalid_api_key" in screen, screen
                await tmux("send-keys", "-t", "top", "q")
                for _ in range(100):
                    if (await tmux("has-session", "-t", "top"))[0] != 0:
                        break
                    await asyncio.sleep(0.05)
                else:
                    pytest.fail("tierproxy top did not quit on q")
            finally:
                await tmux("kill-server")
