"""`tierproxy keys` against a running `tierproxy serve`: a key added by the CLI works once the
proxy's reload picks the file up, a revoked key gets 401, a key past its expiry gets 401 with
the time it expired, and the file's comments survive every edit."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import yaml

from proxy.bench.hostile.kit import Response, exchange, json_request
from proxy.bench.hostile.served import NullBackend, ServedProxy, served_config
from proxy.bench.inproc import KEYS

BODY = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMMENT = "# the keys of the high tenant: edited by `tierproxy keys` (this comment stays)\n"
RELOAD_WAIT_S = 30.0  # the watcher polls every second; this only bounds a failure (busy host)


def _commented_config(backend_url: str) -> str:
    text = yaml.safe_dump(served_config(backend_url, admin=False), sort_keys=False)
    head = "# tierproxy keys round trip: a hand-written config\n"
    return head + text.replace("- name: tenant-high\n", "- name: tenant-high\n  " + COMMENT, 1)


def _keys(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "keys", *args, "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def _chat(proxy: ServedProxy, key: str) -> Response:
    return await exchange(proxy.host, proxy.port, json_request("/v1/chat/completions", BODY, key))


async def _until_status(proxy: ServedProxy, key: str, status: int) -> tuple[Response, float]:
    """The first answer with ``status`` to a request with ``key``, and how long it took."""
    start = time.monotonic()
    while True:
        resp = await _chat(proxy, key)
        waited = time.monotonic() - start
        if resp.status == status or waited > RELOAD_WAIT_S:
            return resp, waited
        await asyncio.sleep(0.05)


async def test_keys_round_trip_on_a_running_proxy(backend: NullBackend, tmp_path: Path) -> None:
    proxy = ServedProxy(served_config(backend.url, admin=False), tmp_path)
    config = proxy.config_path
    config.write_text(_commented_config(backend.url))
    proxy.start()
    try:
        added = await asyncio.to_thread(_keys, config, "add", "tenant-high", "--expires", "30d")
        assert added.returncode == 0, added.stderr
        key = added.stdout.strip()
        assert key.startswith("tp-") and key not in config.read_text()
        resp, took = await _until_status(proxy, key, 200)
        assert resp.status == 200, (resp.status, resp.body)
        print(f"added key answered 200 {took:.2f}s after `keys add` returned")
        assert COMMENT in config.read_text()

        # Rotation with a 4-second overlap: the old key (the demo key) works, then expires.
        old_id = yaml.safe_load(config.read_text())["tenants"][0]["keys"][0]["sha256"][:12]
        rotated_at = time.monotonic()
        rotated = await asyncio.to_thread(
            _keys, config, "rotate", "tenant-high", "--keep", old_id, "--overlap", "4s"
        )
        assert rotated.returncode == 0, rotated.stderr
        new_key = rotated.stdout.strip()
        assert (await _until_status(proxy, new_key, 200))[0].status == 200
        assert (await _chat(proxy, KEYS["high"])).status == 200  # within the overlap
        resp, _ = await _until_status(proxy, KEYS["high"], 401)
        took = time.monotonic() - rotated_at
        assert resp.status == 401 and resp.error_code() == "expired_api_key"
        assert "API key expired at " in str(resp.json())
        assert took >= 4.0, took  # not before the overlap ran out
        print(f"rotated-out key refused {took:.2f}s after `keys rotate` began (overlap 4 s)")

        # Revoke the first added key: 401 as an unknown key, once the reload applied it.
        added_id = yaml.safe_load(config.read_text())["tenants"][0]["keys"][1]["id"]
        revoked = await asyncio.to_thread(_keys, config, "revoke", "tenant-high", added_id)
        assert revoked.returncode == 0, revoked.stderr
        resp, took = await _until_status(proxy, key, 401)
        assert resp.status == 401 and resp.error_code() == "invalid_api_key", resp.body
        print(f"revoked key refused {took:.2f}s after `keys revoke` returned")
        assert (await _chat(proxy, new_key)).status == 200
        assert COMMENT in config.read_text()
        assert config.read_text().startswith("# tierproxy keys round trip")
        assert proxy.tracebacks() == 0
    finally:
        proxy.stop()
