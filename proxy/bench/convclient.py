"""The load of a conversation scenario (``proxy.bench.conversations``) against one URL: each
conversation a closed loop of streamed chat turns, each flood tenant Poisson arrivals of unique
prompts; one record per request with its time to first token and vLLM's usage (cached tokens
with ``--enable-prompt-tokens-details``)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from proxy.bench.conversations import ConversationScenario, ConversationTenant, draw, words

MODEL = "tiny"
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=300, sock_connect=10)


def client_stream(tenant: str, name: str, replica: int = 0) -> random.Random:
    """A client's seeded stream (a conversation slot's, or ``flood``): lengths, max_tokens,
    think times and arrivals. Replica 0 is the benchmark's draw; another draws the same
    shape's clients anew (the simulator's replicas, and ``kv_routing.py --fresh-draws``,
    alike)."""
    key = f"{tenant}/{name}"
    return random.Random(f"{key}/replica{replica}" if replica else key)


@dataclass
class ChatRecord:
    tenant: str
    tier: str
    kind: str  # "turn" | "flood"
    turn: int  # 0 for a flood request
    sent: float  # monotonic
    ttft: float | None  # seconds from send to the first chunk with a choice
    end: float
    status: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # None: vLLM said nothing (flag off)
    request_id: str = ""  # the proxy's X-Request-Id
    conversation: str = ""  # "tenant/slot/n": the n-th conversation of the tenant's slot
    url: str = ""  # where it was sent (the proxy, or an engine when pinned)


async def chat(
    session: aiohttp.ClientSession,
    url: str,
    tenant: ConversationTenant,
    messages: list[dict[str, str]],
    max_tokens: int,
    *,
    kind: str,
    turn: int,
    conversation: str = "",
) -> ChatRecord:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {tenant.api_key}"}
    sent = time.monotonic()
    rec = ChatRecord(tenant.name, tenant.tier, kind, turn, sent, None, sent, 0)
    rec.conversation, rec.url = conversation, url
    try:
        async with session.post(
            f"{url}/v1/chat/completions", json=body, headers=headers, timeout=REQUEST_TIMEOUT
        ) as resp:
            rec.status = resp.status
            rec.request_id = resp.headers.get("X-Request-Id", "")
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = orjson.loads(line[6:])
                if rec.ttft is None and chunk.get("choices"):
                    rec.ttft = time.monotonic() - sent
                usage = chunk.get("usage")
                if usage:
                    _read_usage(rec, usage)
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
        rec.status = rec.status or 599
    rec.end = time.monotonic()
    return rec


def _read_usage(rec: ChatRecord, usage: dict[str, Any]) -> None:
    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        rec.cached_tokens = int(details.get("cached_tokens") or 0)


async def _conversations(
    session: aiohttp.ClientSession,
    url: str,
    tenant: ConversationTenant,
    index: int,
    stop_at: float,
    out: list[ChatRecord],
    replica: int = 0,
) -> None:
    """One conversation slot of ``tenant``: conversations one after another until ``stop_at``,
    each over the tenant's system prompt, growing turn by turn."""
    rng = client_stream(tenant.name, str(index), replica)
    system = tenant.system_prompt()
    for n in itertools.count():
        if time.monotonic() >= stop_at:
            return
        conversation = f"{tenant.name}/{index}/{n}"
        history = [{"role": "system", "content": system}]
        for turn in range(1, tenant.turns + 1):
            if time.monotonic() >= stop_at:
                return
            history.append(
                {"role": "user", "content": words(rng, int(draw(rng, tenant.user_words)))}
            )
            max_tokens = int(draw(rng, tenant.max_tokens))
            out.append(
                await chat(
                    session,
                    url,
                    tenant,
                    history,
                    max_tokens,
                    kind="turn",
                    turn=turn,
                    conversation=conversation,
                )
            )
            reply = words(rng, int(draw(rng, tenant.reply_words)))
            history.append({"role": "assistant", "content": reply})
            await asyncio.sleep(draw(rng, tenant.think_s))


async def _flood(
    session: aiohttp.ClientSession,
    url: str,
    tenant: ConversationTenant,
    stop_at: float,
    out: list[ChatRecord],
    replica: int = 0,
) -> None:
    rng = client_stream(tenant.name, "flood", replica)
    tasks: set[asyncio.Task[None]] = set()

    async def one(prompt: str, max_tokens: int) -> None:
        messages = [{"role": "user", "content": prompt}]
        out.append(await chat(session, url, tenant, messages, max_tokens, kind="flood", turn=0))

    try:
        while (left := stop_at - time.monotonic()) > 0:
            await asyncio.sleep(min(left, rng.expovariate(tenant.rate_rps)))
            if time.monotonic() >= stop_at:
                break
            prompt = words(rng, int(draw(rng, tenant.prompt_words)))
            task = asyncio.create_task(one(prompt, int(draw(rng, tenant.max_tokens))))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


async def run_load(
    url: str | Mapping[str, str],
    scenario: ConversationScenario,
    duration_s: float,
    replica: int = 0,
) -> list[ChatRecord]:
    """Every tenant's load for ``duration_s`` (requests in flight then are awaited). ``url``:
    the proxy, or each tenant's own engine by name (pinned, the proxy bypassed); ``replica``:
    the clients' draw (``client_stream``)."""
    out: list[ChatRecord] = []
    stop_at = time.monotonic() + duration_s
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        jobs = []
        for tenant in scenario.tenants:
            target = url if isinstance(url, str) else url[tenant.name]
            if tenant.rate_rps > 0:
                jobs.append(_flood(session, target, tenant, stop_at, out, replica))
            for i in range(tenant.conversations):
                jobs.append(_conversations(session, target, tenant, i, stop_at, out, replica))
        await asyncio.gather(*jobs)
    return out
