"""Live config reload under load, against real vLLM."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import pytest
import yaml

from proxy.bench.inproc import KEYS, auth, make_config, running_proxy, until
from proxy.config.tenants import hash_key
from proxy.server.state import ProxyState
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import CORE

pytestmark = [pytest.mark.integration, pytest.mark.engines(CORE)]
ADMIN_KEY = "admin-key-for-the-reload-test"
TIMEOUT = aiohttp.ClientTimeout(total=180)
BODY = {
    "model": "tiny",
    "max_tokens": 16,
    "ignore_eos": True,
    "messages": [{"role": "user", "content": "hi"}],
}


def _generation(state: ProxyState) -> float:
    return float(state.metrics.config_generation._value.get())


async def _reloaded(state: ProxyState, after: float) -> float:
    await until(lambda: _generation(state) > after, 15, "the config reloaded", state)
    return _generation(state)


async def test_edits_during_load_apply_atomically_and_broken_file_changes_nothing(
    engines: EngineFarm, tmp_path: Path
) -> None:
    engine = engines.get(CORE)
    path = tmp_path / "tierproxy.yaml"
    cfg = make_config(
        [{"url": engine.spec.url, "max_inflight": 4}],
        admin_keys=[{"sha256": hash_key(ADMIN_KEY)}],  # /metrics on the client listener needs one
    )
    async with (
        running_proxy(cfg, config_path=path) as (base, state),
        aiohttp.ClientSession(timeout=TIMEOUT) as s,
    ):
        statuses: list[int] = []
        stop = asyncio.Event()

        async def load(tier: str) -> None:
            while not stop.is_set():
                async with s.post(
                    f"{base}/v1/chat/completions", json=BODY, headers=auth(tier)
                ) as r:
                    await r.read()
                    statuses.append(r.status)

        async def answered(more: int) -> None:
            """Until ``more`` requests more were answered: load runs across the next step."""
            goal = len(statuses) + more
            await until(lambda: len(statuses) >= goal, 60, f"{more} more answers", state)

        workers = [
            asyncio.create_task(load(t)) for t in ("high", "normal", "low") for _ in range(3)
        ]
        gen = _generation(state)
        await answered(20)

        # 1. Move the low tenant to the high tier and lower the normal tier's cap.
        cfg["tenants"][2]["tier"] = "high"
        cfg["tiers"]["normal"]["max_queue"] = 50
        path.write_text(yaml.safe_dump(cfg))
        gen = await _reloaded(state, gen)
        moved = state.loaded.tenant_for_key(KEYS["low"])
        assert moved is not None and moved.tier == "high"
        assert state.queue.limits("normal").max_queue == 50
        await answered(20)

        # 2. Revoke the normal tenant's key (SIGHUP this time): 401 at once.
        revoked_at = len(statuses)  # every request answered before this was sent before it
        cfg["tenants"][1]["keys"] = [{"sha256": "0" * 64}]
        path.write_text(yaml.safe_dump(cfg))
        os.kill(os.getpid(), signal.SIGHUP)
        gen = await _reloaded(state, gen)
        async with s.post(f"{base}/v1/chat/completions", json=BODY, headers=auth("normal")) as r:
            assert r.status == 401

        # 3. A broken file: the old config stays, the failure shows in /metrics.
        path.write_text(yaml.safe_dump(cfg).replace("weight: 10", "weight: -10"))
        await until(
            lambda: state.metrics.config_reloads.labels("error")._value.get() >= 1,
            15,
            "the broken file refused",
            state,
        )
        assert state.metrics.config_generation._value.get() == gen
        assert state.config.tiers["high"].weight == 10
        async with s.get(f"{base}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            assert 'tierproxy_config_reloads_total{result="error"} 1.0' in await r.text()
        await answered(10)
        stop.set()
        await asyncio.gather(*workers)

    # No request failed because of a reload: all 200 until the key was revoked; after it, the
    # revoked tenant's workers get 401 and everyone else still 200.
    before, after = statuses[:revoked_at], statuses[revoked_at:]
    assert set(before) == {200} and len(before) > 20
    assert set(after) == {200, 401}
