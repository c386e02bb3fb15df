"""The live view against a real proxy in front of a real (confined) vLLM: ``tierproxy top``
driven in a tmux terminal (start, read the screen, quit), and the Grafana dashboard's vLLM
metric names checked against vLLM's own /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.bench.inproc import KEYS, auth, make_config, running_proxy
from proxy.config.tenants import hash_key
from tests.helpers.dashboard import exposed_names, queried_names
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import CORE
from tests.helpers.paths import REPO

pytestmark = [pytest.mark.integration, pytest.mark.engines(CORE)]
ADMIN_KEY = "live-view-admin-key"
TIMEOUT = aiohttp.ClientTimeout(total=60)
# The last good screen, for docs/live-view.md (the test-logs folder is not in git).
CAPTURE = REPO / ".tierproxy" / "test-logs" / "live-view-capture.txt"


async def _tmux(socket: str, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        "tmux",
        "-L",
        socket,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(10):
        out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode(errors="replace")


async def _load(base: str, tier: str, stop: asyncio.Event) -> None:
    """Streams back to back from one tier until stopped: vLLM keeps running something."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        while not stop.is_set():
            async with session.post(
                f"{base}/v1/chat/completions", json=body, headers=auth(tier)
            ) as resp:
                await resp.read()


@contextlib.asynccontextmanager
async def _loaded(base: str) -> AsyncIterator[None]:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_load(base, t, stop)) for t in ("high",) * 3 + ("low",) * 3]
    try:
        yield
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _cells(screen: str, first: str) -> list[str] | None:
    """The cells of the table row whose first cell is ``first``."""
    for line in screen.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line)[1:-1]]
        if cells and cells[0] == first:
            return cells
    return None


def _number(cell: str) -> float | None:
    try:
        return float(cell.split("/")[0].rstrip("%"))
    except ValueError:
        return None


def _screen_is_complete(screen: str) -> bool:
    """Tiers, tenants and backends with real numbers: vLLM running work, tokens flowing, a
    limit hit, a queue-wait percentile."""
    backend, high, normal = (
        _cells(screen, n) for n in ("vllm-core", "tenant-high", "tenant-normal")
    )
    tier = _cells(screen, "high")
    if not (backend and high and normal and tier and "tiers" in screen):
        return False
    running, kv = _number(backend[4]), _number(backend[6])
    return (
        backend[1] in ("healthy", "ramping")
        and running is not None
        and running >= 1
        and kv is not None
        and (_number(high[4]) or 0) > 0  # tokens/s
        and "requests_per_minute" in normal[7]
        and _number(tier[5]) is not None  # wait p99
    )


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (make test does)")
async def test_top_in_a_terminal_shows_tiers_tenants_and_backends(
    engines: EngineFarm, tmp_path: Path
) -> None:
    engine = engines.get(CORE)
    tenants: list[dict[str, Any]] = [
        {"name": f"tenant-{tier}", "tier": tier, "keys": [{"sha256": hash_key(key)}]}
        for tier, key in KEYS.items()
    ]
    tenants[1]["requests_per_minute"] = 2  # tenant-normal: its third request gets a 429
    config = make_config(
        [{"url": engine.spec.url, "name": "vllm-core"}],
        tenants=tenants,
        admin_keys=[{"sha256": hash_key(ADMIN_KEY)}],
    )
    socket = f"tierproxy-test-{os.getpid()}"
    async with running_proxy(config) as (base, _state), _loaded(base):
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            statuses = []
            for _ in range(3):
                body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
                async with session.post(
                    f"{base}/v1/completions", json=body, headers=auth("normal")
                ) as resp:
                    statuses.append(resp.status)
            assert statuses == [200, 200, 429]
            async with session.get(f"{engine.spec.url}/metrics") as resp:
                vllm_names = exposed_names(await resp.text())
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            async with session.get(f"{base}/metrics", headers=admin) as resp:
                proxy_names = exposed_names(await resp.text())
        # The dashboard queries only names that exist: vLLM's on a real vLLM, ours on the proxy.
        assert {n for n in queried_names() if n.startswith("vllm:")} <= vllm_names
        assert {n for n in queried_names() if n.startswith("tierproxy_")} <= proxy_names

        command = (
            # pytest exports COLUMNS and LINES, which rich would take over the pane's size.
            f"env -u COLUMNS -u LINES TIERPROXY_ADMIN_KEY={ADMIN_KEY} PYTHONPATH={REPO}"
            f" {sys.executable} -m proxy.cli top --proxy {base}"
        )
        rc, out = await _tmux(
            socket, "new-session", "-d", "-s", "top", "-x", "160", "-y", "48", command
        )
        assert rc == 0, out
        try:
            screen = ""
            deadline = asyncio.get_running_loop().time() + 60
            while not _screen_is_complete(screen):
                assert asyncio.get_running_loop().time() < deadline, f"screen:\n{screen}"
                await asyncio.sleep(0.5)
                rc, screen = await _tmux(socket, "capture-pane", "-p", "-t", "top")
                assert rc == 0, screen
            CAPTURE.parent.mkdir(parents=True, exist_ok=True)
            CAPTURE.write_text(screen)
            await _tmux(socket, "send-keys", "-t", "top", "q")
            for _ in range(50):  # the view quits, and its session with it
                if (await _tmux(socket, "has-session", "-t", "top"))[0] != 0:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("tierproxy top did not quit on q")
        finally:
            await _tmux(socket, "kill-server")
