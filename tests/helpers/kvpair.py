"""The kit of the kv_aware red-team tests against `tierproxy serve` and two real CPU vLLMs
(tests/integration/test_kv_placement_served.py, test_kv_served_edges.py): the second engine's
setting, the proxy's config, and what the tests read of the engines and the proxy."""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import AsyncIterator, Set
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import zmq.asyncio

from proxy.backends.kvreplay import replay
from proxy.bench.hostile.served import ADMIN_KEY, ServedProxy, admin_sections
from proxy.bench.inproc import KEYS, make_config
from proxy.tools.engine import EngineProcess
from tests.helpers.engines import KV_EVENTS, EngineSetting

# A second engine like KV_EVENTS (its own ports, its own cache).
KV_EVENTS_B = EngineSetting("prefix-cache-b", plugin=True, kv_events=True, env=KV_EVENTS.env)
BLOCK = 32
CHAT = "/v1/chat/completions"
TIMEOUT = aiohttp.ClientTimeout(total=120)


def kv_pair_config(a: EngineProcess, b: EngineProcess, **extra: Any) -> dict[str, Any]:
    backends = [{"url": e.spec.url, "max_inflight": 4} for e in (a, b)]
    return make_config(
        backends,
        kv_cache={"enabled": True, "tokenizer": a.spec.model, "block_size": BLOCK},
        policies={"backends": "kv_aware"},
        **admin_sections(),
        **extra,
    )


async def served_count(session: aiohttp.ClientSession, engine: EngineProcess) -> float:
    """The engine's own count of requests it finished."""
    async with session.get(engine.spec.url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M)
    )


async def proxy_metrics(session: aiohttp.ClientSession, proxy: ServedProxy) -> str:
    async with session.get(proxy.admin_url + "/metrics") as resp:
        return await resp.text()


async def until_trusted(
    session: aiohttp.ClientSession, proxy: ServedProxy, exact: Set[str] = frozenset()
) -> None:
    """Both backends' indexes trusted (``tierproxy_kv_index_trust`` 1, partial, or more), and
    exact (2) for the backends of ``exact`` (their urls), counted in polls."""
    for _ in range(300):
        text = await proxy_metrics(session, proxy)
        trust = dict(re.findall(r'^tierproxy_kv_index_trust\{backend="([^"]*)"\} (\S+)$', text, re.M))  # fmt: skip
        if len(trust) == 2 and all(float(t) >= 1 + (url in exact) for url, t in trust.items()):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"indexes never trusted: {trust} (exact wanted: {sorted(exact)})")


async def replay_holds_first_batch(engine: EngineProcess) -> bool:
    """Whether the engine's KV-event replay buffer still holds its whole history from its first
    batch (or it published none): what a new proxy's index is made exact from. Asked as the
    proxy asks it (``KvSubscriber._replay_history``), with the default message bound."""
    assert engine.spec.kv_replay_port is not None
    ctx = zmq.asyncio.Context()
    try:
        endpoint = f"tcp://127.0.0.1:{engine.spec.kv_replay_port}"
        history = await replay(ctx, endpoint, 0, None, timeout_s=60, max_msg_bytes=4 * 1024 * 1024)
    finally:
        ctx.destroy(linger=0)
    return history is not None


class Client:
    def __init__(self, session: aiohttp.ClientSession, proxy: ServedProxy) -> None:
        self.session, self.proxy = session, proxy

    async def post(self, tier: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        headers = {"Authorization": f"Bearer {KEYS[tier]}"}
        async with self.session.post(self.proxy.url + CHAT, json=body, headers=headers) as r:
            return r.status, await r.json(content_type=None)

    async def chat(self, tier: str, messages: list[dict[str, str]], **extra: Any) -> int:
        """vLLM's cached prompt tokens of one chat turn that must succeed."""
        body = {"model": "tiny", "messages": messages, "max_tokens": 1, **extra}
        status, answer = await self.post(tier, body)
        assert status == 200, answer
        return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

    @asynccontextmanager
    async def running(self, tier: str, messages: list[dict[str, str]]) -> AsyncIterator[None]:
        """A long generation of ``messages``, streaming: inside, its first chunk has arrived
        (it runs on an engine); on leaving, the client closes it."""
        body = {"model": "tiny", "messages": messages, "max_tokens": 1600, "ignore_eos": True}
        body["stream"] = True
        headers = {"Authorization": f"Bearer {KEYS[tier]}"}
        async with self.session.post(self.proxy.url + CHAT, json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            await r.content.readline()
            yield


def system_prompt(tag: str) -> str:
    """A system prompt of ~300 tokens no other shares (its tag first)."""
    return f"{tag} " + " ".join(f"rule{i % 97}" for i in range(150))


def conversation(system: str, n: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": f"q{n}?"}]


async def inflight(session: aiohttp.ClientSession, proxy: ServedProxy) -> list[int]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with session.get(proxy.admin_url + "/admin/backends", headers=headers) as resp:
        return [int(b["inflight"]) for b in (await resp.json())["backends"]]


async def kept_placement(session: aiohttp.ClientSession, proxy: ServedProxy) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with session.get(proxy.admin_url + "/admin/status", headers=headers) as resp:
        placement = (await resp.json())["kv_placement"]
    return dict(placement["tenants"])


async def write_diagnosis(
    session: aiohttp.ClientSession,
    proxy: ServedProxy,
    engines: tuple[EngineProcess, ...],
    usage_log: Path,
    where: Path,
) -> None:
    """What the proxy and the engines showed after a pick a test did not expect, to
    ``where``.json (and the proxy's log beside it): the usage records (the index's prediction
    at each pick), the chooser's placement, the backends' state, the proxy's index metrics and
    the engines' queues and KV usage."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    found: dict[str, Any] = {"usage": [orjson.loads(x) for x in usage_log.read_bytes().splitlines()]}  # fmt: skip
    for path in ("/admin/status", "/admin/backends"):
        async with session.get(proxy.admin_url + path, headers=headers) as resp:
            found[path] = await resp.json(content_type=None)
    metrics = await proxy_metrics(session, proxy)
    found["proxy_kv_metrics"] = [x for x in metrics.splitlines() if x.startswith("tierproxy_kv_")]
    for engine in engines:
        async with session.get(engine.spec.url + "/metrics") as resp:
            text = await resp.text()
        wanted = ("vllm:num_requests_", "vllm:kv_cache_usage", "vllm:request_success_total")
        found[engine.spec.url] = [x for x in text.splitlines() if x.startswith(wanted)]
    where.with_suffix(".json").write_bytes(orjson.dumps(found, option=orjson.OPT_INDENT_2))
    shutil.copyfile(proxy.log_path, where.with_suffix(".proxy.log"))
