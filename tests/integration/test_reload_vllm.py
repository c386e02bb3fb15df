"""Live config reload under load, against real vLLM."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from tests.proxyrun import KEYS, auth, make_config, running_proxy

pytestmark = pytest.mark.integration
TIMEOUT = aiohttp.ClientTimeout(total=180)
BODY = {"model": "tiny", "max_tokens": 16, "ignore_eos": True,
        "messages": [{"role": "user", "content": "hi"}]}


async def _generation(state: Any, after: float, timeout_s: float = 15.0) -> float:
    deadline = time.monotonic() + timeout_s
    while state.metrics.config_generation._value.get() <= after:
        assert time.monotonic() < deadline, "the config was not reloaded"
        await asyncio.sleep(0.05)
    return float(state.metrics.config_generation._value.get())


async def test_edits_during_load_apply_atomically_and_broken_file_changes_nothing(
    engines, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    engine = engines.get("core")
    path = tmp_path / "tierproxy.yaml"
    cfg = make_config([{"url": engine.spec.url, "max_inflight": 4}])
    async with running_proxy(cfg, config_path=path) as (base, state), \
            aiohttp.ClientSession(timeout=TIMEOUT) as s:
        statuses: list[int] = []
        stop = asyncio.Event()

        async def load(tier: str) -> None:
            while not stop.is_set():
                async with s.post(f"{base}/v1/chat/completions", json=BODY,
                                  headers=auth(tier)) as r:
                    await r.read()
                    statuses.append(r.status)

        workers = [asyncio.create_task(load(t)) for t in ("high", "normal", "low") for _ in range(3)]
        gen = float(state.metrics.config_generation._value.get())
        await asyncio.sleep(1.0)

        # 1. Move the low tenant to the high tier and lower the normal tier's cap.
        cfg["tenants"][2]["tier"] = "high"
        cfg["tiers"]["normal"]["max_queue"] = 50
        path.write_text(yaml.safe_dump(cfg))
        gen = await _generation(state, gen)
        assert state.loaded.tenant_for_key(KEYS["low"]).tier == "high"
        assert state.queue.limits("normal").max_queue == 50
        await asyncio.sleep(1.0)

        # 2. Revoke the normal tenant's key (SIGHUP this time): 401 at once.
        revoked_at = len(statuses)  # every request answered before this was sent before it
        cfg["tenants"][1]["keys"] = [{"sha256": "0" * 64}]
        path.write_text(yaml.safe_dump(cfg))
        os.kill(os.getpid(), signal.SIGHUP)
        gen = await _generation(state, gen)
        async with s.post(f"{base}/v1/chat/completions", json=BODY, headers=auth("normal")) as r:
            assert r.status == 401

        # 3. A broken file: the old config stays, the failure shows in /metrics.
        path.write_text(yaml.safe_dump(cfg).replace("weight: 10", "weight: -10"))
        deadline = time.monotonic() + 15
        while state.metrics.config_reloads.labels("error")._value.get() < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert state.metrics.config_generation._value.get() == gen
        assert state.config.tiers["high"].weight == 10
        async with s.get(f"{base}/metrics") as r:
            assert 'tierproxy_config_reloads_total{result="error"} 1.0' in await r.text()
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*workers)

    # No request failed because of a reload: all 200 until the key was revoked; after it, the
    # revoked tenant's workers get 401 and everyone else still 200.
    before, after = statuses[:revoked_at], statuses[revoked_at:]
    assert set(before) == {200} and len(before) > 20
    assert set(after) == {200, 401}
