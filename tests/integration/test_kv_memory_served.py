"""kv_aware's placement memory against `tierproxy serve` (a subprocess) in front of one real CPU
vLLM (prefix caching, KV events, a 2,048-token context): one tenant's placement, read on
/admin/status (``kv_placement``), survives another tenant's flood of prompts past the model's
context (never hashed), prompts vLLM refuses with a 400 (hashed, sent, no trace kept), and real
work past its share of the memory (it evicts its own). The memory is made small
(``kv_aware.memory_blocks``) so that the flood is many times its room. The in-process twins:
tests/unit/policies/test_kvmemory.py, tests/unit/request/test_kv_memory_path.py."""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.bench.hostile.kit import exchange, json_request, request_bytes
from proxy.bench.hostile.served import ADMIN_KEY, ServedProxy, served_config
from proxy.bench.inproc import KEYS
from proxy.tools.engine import EngineProcess
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import KV_EVENTS

pytestmark = [pytest.mark.integration, pytest.mark.engines(KV_EVENTS)]
MEMORY = 240  # (backend, block) pairs: a tenant under half of it keeps its own


@pytest.fixture(scope="module")
def engine(engines: EngineFarm) -> EngineProcess:
    return engines.get(KV_EVENTS)


async def _admin(proxy: ServedProxy, path: str) -> Any:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    port = proxy.admin_port or proxy.port
    resp = await exchange(proxy.host, port, request_bytes("GET", path, admin))
    assert resp.status == 200, resp.body[:300]
    return orjson.loads(resp.body)


async def _placement(proxy: ServedProxy) -> dict[str, dict[str, int]]:
    placement = (await _admin(proxy, "/admin/status"))["kv_placement"]
    assert placement is not None and placement["capacity"] == MEMORY
    assert placement["in_flight"] == 0
    tenants: dict[str, dict[str, int]] = placement["tenants"]
    return tenants


async def _post(proxy: ServedProxy, tier: str, path: str, body: dict[str, Any]) -> int:
    resp = await exchange(
        proxy.host, proxy.port, json_request(path, body, KEYS[tier]), timeout_s=120
    )
    return resp.status


def _ids(n: int) -> list[int]:
    """``n`` token ids of a prompt no other shares (the tiny model's vocabulary: 1000s)."""
    start = secrets.randbelow(200)
    return [100 + (start + 7 * i) % 800 for i in range(n)]


async def test_a_tenants_placement_survives_another_tenants_flood(
    engine: EngineProcess, tmp_path: Path
) -> None:
    config = served_config(
        engine.spec.url,
        kv_cache={"enabled": True, "tokenizer": engine.spec.model, "block_size": 32},
        policies={"backends": "kv_aware", "kv_aware": {"memory_blocks": MEMORY}},
    )
    with ServedProxy(config, tmp_path).start() as proxy:
        deadline = time.monotonic() + 30  # the proxy knows the model's context once probed
        while (await _admin(proxy, "/admin/backends"))["backends"][0]["models"] is None:
            assert time.monotonic() < deadline, "the backend's /v1/models never probed"
        # The quiet tenant's three conversations (about 320 tokens each): its placement.
        for n in range(3):
            system = f"tenant-high conversation {n} " + " ".join(f"rule{i}" for i in range(150))
            body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}  # fmt: skip
            assert await _post(proxy, "high", "/v1/chat/completions", body) == 200
        before = await _placement(proxy)
        quiet = before["tenant-high"][engine.spec.url]
        assert 20 <= quiet < MEMORY // 2, before
        # The flood: past the context (vLLM would answer 400; the proxy hashes nothing) ...
        statuses = []
        for _ in range(6):
            body = {"model": "tiny", "prompt": _ids(120_000), "max_tokens": 1}
            statuses.append(await _post(proxy, "low", "/v1/completions", body))
        # ... refused by vLLM (a negative temperature: 400 before any engine work), hashed and
        # sent: 12 prompts of 31 blocks, more than the whole memory ...
        for _ in range(12):
            body = {"model": "tiny", "prompt": _ids(1_000), "max_tokens": 1, "temperature": -1}
            statuses.append(await _post(proxy, "low", "/v1/completions", body))
        assert statuses and all(400 <= s < 500 for s in statuses), statuses
        refused = await _placement(proxy)
        assert refused == before, "a request that did not run left a trace"
        # ... and real work, far more than its share of the memory: it evicts its own.
        for _ in range(12):
            body = {"model": "tiny", "prompt": _ids(1_000), "max_tokens": 1}
            assert await _post(proxy, "low", "/v1/completions", body) == 200
        after = await _placement(proxy)
        assert after["tenant-high"] == before["tenant-high"], after
        flood = sum(after["tenant-low"].values())
        assert flood == MEMORY - quiet, after  # the rest of the room, no more
