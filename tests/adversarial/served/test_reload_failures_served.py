"""A config the running `tierproxy serve` cannot load never stops its later reloads (attack
round 2, k01): an ``expires_at`` out of range once in UTC, YAML nested 600 deep and a config
that cannot be read are each logged and counted as a failed reload, the old config keeps
serving, and a later `tierproxy keys revoke` still takes effect. Before, the first two killed the
watcher silently (the revoked key kept answering 200) and the third was not reported at all."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from proxy.bench.hostile.kit import exchange, json_request, request_bytes
from proxy.bench.hostile.served import ADMIN_KEY, NullBackend, ServedProxy, served_config
from proxy.config.tenants import hash_key

BODY = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
VICTIM = "victim-key-0123456789"
WAIT_S = 10.0  # the watcher polls every second; this only bounds a failure


async def _reloads(proxy: ServedProxy, result: str) -> float:
    req = request_bytes("GET", "/metrics", {"Authorization": f"Bearer {ADMIN_KEY}"})
    resp = await exchange(proxy.host, proxy.admin_port or proxy.port, req)
    assert resp.status == 200, resp.body[:300]
    prefix = f'tierproxy_config_reloads_total{{result="{result}"}} '
    for line in resp.body.decode().splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


async def _until_reloads(proxy: ServedProxy, result: str, count: float) -> float:
    deadline = time.monotonic() + WAIT_S
    while (seen := await _reloads(proxy, result)) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return seen


async def _victim_status(proxy: ServedProxy) -> int:
    req = json_request("/v1/chat/completions", BODY, VICTIM)
    return (await exchange(proxy.host, proxy.port, req)).status


def _rename_in(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_files_that_fail_to_load_never_stop_later_reloads(
    backend: NullBackend, tmp_path: Path
) -> None:
    config = served_config(backend.url)
    victim = {"sha256": hash_key(VICTIM), "expires_at": "PLACE"}
    config["tenants"][2]["keys"].append(victim)
    timed = yaml.safe_dump(config)
    del victim["expires_at"]
    good = yaml.safe_dump(config)
    proxy = ServedProxy(config, tmp_path)
    proxy.config_path.write_text(good)
    proxy.start()
    try:
        assert await _victim_status(proxy) == 200
        mark = proxy.mark()
        # A 'never expires' written in a local zone: past the year 9999 in UTC.
        _rename_in(proxy.config_path, timed.replace("PLACE", "9999-12-31T23:59:59-12:00"))
        assert await _until_reloads(proxy, "error", 1) == 1
        assert proxy.count(r"tenants\.2\.keys\.1\.expires_at \(line \d+\): .*out of range", mark)
        deep = "zz:\n" + "".join(" " * (i + 1) + "a:\n" for i in range(600)) + " " * 602 + "b: 1\n"
        _rename_in(proxy.config_path, good + deep)
        assert await _until_reloads(proxy, "error", 2) == 2
        assert proxy.count(r"nested more than \d+ levels deep", mark) == 1
        proxy.config_path.unlink()
        assert await _until_reloads(proxy, "error", 3) == 3
        assert proxy.count(r"reload failed, keeping the old config: cannot read", mark) == 1
        assert await _victim_status(proxy) == 200  # the old config served throughout

        _rename_in(proxy.config_path, good)  # back as it was: nothing to apply
        digest = hash_key(VICTIM)
        revoke = [sys.executable, "-m", "proxy.cli", "keys", "revoke", "tenant-low", digest[:12]]
        done = await asyncio.to_thread(
            subprocess.run,
            [*revoke, "-c", str(proxy.config_path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert await _until_reloads(proxy, "ok", 1) == 1
        assert await _victim_status(proxy) == 401
        assert await _reloads(proxy, "error") == 3
        assert proxy.tracebacks() == 0
    finally:
        proxy.stop()
