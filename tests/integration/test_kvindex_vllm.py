"""The prefix-cache index (proxy.backends.kvindex, fed by vLLM's KV events) against a real
vLLM with ``--enable-prefix-caching --enable-prompt-tokens-details`` and a ZMQ publisher: what
the index predicts a prompt finds cached, in tokens, equals what vLLM reports it found
(``usage.prompt_tokens_details.cached_tokens``) for repeated and extended prompts, per tenant
salt; and the index recovers after its subscriber reconnects and after the engine restarts.

The prediction is read where the backend chooser reads it: the request's ``prompt_blocks`` as
the pipeline computed them, against the backend's ``cached_blocks``, when it is queued.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from proxy.backends.backend import BackendState
from proxy.backends.kvindex import Trust
from proxy.bench.inproc import auth, make_config, running_proxy, until
from proxy.policies.types import QueuedRequest
from proxy.server.state import ProxyState
from proxy.tools.engine import EngineProcess
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import KV_EVENTS

pytestmark = [pytest.mark.integration, pytest.mark.engines(KV_EVENTS)]
TIMEOUT = aiohttp.ClientTimeout(total=60)
BLOCK = 32


@pytest.fixture(scope="module")
def engine(engines: EngineFarm) -> EngineProcess:
    return engines.get(KV_EVENTS)


class Predictions:
    """Wraps the dispatcher the pipeline queues through: records, per request, the backend
    index's prediction at that moment (None: cold)."""

    def __init__(self, state: ProxyState) -> None:
        self.inner = state.pipeline.dispatcher
        self.backend: BackendState = state.pool.all()[0]
        self.seen: list[tuple[QueuedRequest, int | None]] = []
        state.pipeline.dispatcher = self  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def enqueue(self, request: QueuedRequest, **kw: Any) -> Any:
        assert request.prompt_blocks is not None, "the pipeline computed no prompt blocks"
        self.seen.append((request, self.backend.cached_blocks(request.prompt_blocks)))
        return self.inner.enqueue(request, **kw)


@asynccontextmanager
async def proxy(
    engine: EngineProcess, resync_s: float, *, local: bool = True
) -> AsyncIterator[tuple[str, Any]]:
    """``local``: tokenized with the model's directory; else through vLLM's /tokenize."""
    tokenizer = engine.spec.model if local else None
    kv = {"enabled": True, "tokenizer": tokenizer, "block_size": BLOCK}
    config = make_config(
        [{"url": engine.spec.url, "max_inflight": 2}], kv_cache={**kv, "resync_s": resync_s}
    )
    async with running_proxy(config) as (base, state):
        await until(lambda: state.pool.all()[0].kv_index is not None, 10, "the subscriber")
        yield base, state


class Client:
    def __init__(self, session: aiohttp.ClientSession, base: str, state: ProxyState) -> None:
        self.session, self.base, self.state = session, base, state
        self.predictions = Predictions(state)

    async def chat(self, tier: str, messages: list[dict[str, str]]) -> tuple[int | None, int]:
        """(predicted cached tokens, vLLM's cached_tokens) of one chat request."""
        body = {"model": "tiny", "messages": messages, "max_tokens": 1}
        return await self._send(tier, "/v1/chat/completions", body)

    async def complete(self, tier: str, prompt: str) -> tuple[int | None, int]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        return await self._send(tier, "/v1/completions", body)

    async def _send(self, tier: str, path: str, body: dict[str, Any]) -> tuple[int | None, int]:
        async with self.session.post(self.base + path, json=body, headers=auth(tier)) as resp:
            assert resp.status == 200, await resp.text()
            usage = (await resp.json())["usage"]
        request, blocks = self.predictions.seen[-1]
        assert request.prompt_blocks is not None
        # Its blocks reach the index with the engine's next events: wait for them, so that the
        # next request's prediction is not a race with the event stream.
        backend = self.predictions.backend
        want = len(request.prompt_blocks)
        await until(lambda: backend.cached_blocks(request.prompt_blocks or ()) in (None, want), 10)
        return (None if blocks is None else blocks * BLOCK), usage["prompt_tokens_details"][
            "cached_tokens"
        ]


def _conversation(turns: int = 1) -> list[dict[str, str]]:
    system = f"{secrets.token_hex(8)} " + " ".join(f"rule{i % 89}" for i in range(150))
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn} " + "why " * (7 + turn)})
        messages.append({"role": "assistant", "content": f"answer {turn} " + "because " * 5})
    return [*messages, {"role": "user", "content": "and now? " * 3}]


async def _warm(client: Client, probes: int = 10) -> None:
    """Until the index is warm. Warm comes with the first batch the subscriber hears, and a
    subscriber that has just (re)connected may miss the batches of a request sent meanwhile (its
    subscription reaches the engine's publisher after them: ZMQ drops what a PUB sends before
    it knows the SUB): a small probe prompt is sent whenever nothing made it warm for a while,
    as the next request of any workload would. Counts probes, not seconds."""
    index = client.predictions.backend.kv_index
    assert index is not None
    for _ in range(probes):
        for _ in range(30):  # polls ~3 s (a replay takes one round trip to the engine)
            if index.warm():
                return
            await asyncio.sleep(0.1)
        await client.complete("low", f"probe {secrets.token_hex(6)} " + "warm " * 40)
    assert index.warm(), f"no warm index after {probes} probe prompts"


@pytest.mark.parametrize("local", [True, False], ids=["local-tokenizer", "vllm-tokenize"])
async def test_predicted_cached_tokens_equal_vllms(engine: EngineProcess, local: bool) -> None:
    async with (
        proxy(engine, resync_s=0, local=local) as (base, state),
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
    ):
        client = Client(session, base, state)
        await _warm(client)
        conversation = _conversation(turns=1)
        first = await client.chat("high", conversation)
        assert first == (0, 0)
        again = await client.chat("high", conversation)
        assert again[0] == again[1] and again[1] > 0, again
        # The next turn: the conversation so far is a cached prefix, up to its last full block.
        longer = [*conversation, {"role": "assistant", "content": "ok " * 9}]
        longer.append({"role": "user", "content": "more " * 20})
        extended = await client.chat("high", longer)
        assert extended[0] == extended[1] and extended[1] >= again[1], extended
        # Another tenant's salt: vLLM finds nothing, and the index says so.
        assert await client.chat("normal", longer) == (0, 0)
        # A completion (the prompt tokenized with special tokens), repeated and extended.
        text = f"{secrets.token_hex(6)} " + "lorem ipsum dolor " * 40
        assert await client.complete("low", text) == (0, 0)
        repeat = await client.complete("low", text)
        extended_text = await client.complete("low", text + " sit amet" * 30)
        for predicted, reported in (repeat, extended_text):
            assert predicted == reported and reported > 0, (repeat, extended_text)


@pytest.mark.long  # the engine is killed and started again (~30 s)
@pytest.mark.restarts_engines
async def test_index_recovers_after_reconnect_and_engine_restart(engine: EngineProcess) -> None:
    # No resync window to wait out: warm comes from the replay socket or an engine's batch 0.
    async with (
        proxy(engine, resync_s=3600) as (base, state),
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
    ):
        client = Client(session, base, state)
        watcher = state.kv_watcher
        assert watcher is not None
        backend = client.predictions.backend
        # The engine served earlier tests before this proxy subscribed: cold until its first
        # batch is heard, and then the batches before it come from the replay socket: warm,
        # with what was stored before too.
        before = _conversation()
        assert await client.chat("high", before) == (None, 0)
        await _warm(client)  # from the replay: resync_s alone would take an hour
        repeated = await client.chat("high", before)
        assert repeated[0] == repeated[1] > 0, repeated

        # The subscriber reconnects: its index is dropped and cold; the next batch brings the
        # rest back through the replay socket, the blocks stored before the reconnect included.
        await watcher._stop({engine.spec.url})
        await watcher.sync()
        assert backend.kv_index is not None and not backend.kv_index.warm()
        assert backend.cached_blocks((1, 2, 3)) is None
        fresh = _conversation()
        assert await client.chat("high", fresh) == (None, 0)
        await _warm(client)
        again_before = await client.chat("high", before)
        assert again_before[0] == again_before[1] > 0, again_before
        hit = await client.chat("high", fresh)
        assert hit[0] == hit[1] > 0, hit

        # The engine restarts: its cache is empty and so is the index, exact before any
        # request: the new engine's replay holds no batch (it never published one: it stored
        # nothing); nothing from before is predicted, new prompts are exactly.
        engine.stop()
        await until(lambda: not backend.kv_index or not backend.kv_index.warm(), 20, "cold")
        engine.start()
        await _wait_ready(engine)

        def exact() -> bool:
            return backend.kv_index is not None and backend.kv_index.trust() == Trust.EXACT

        await until(exact, 30, "exact from the new engine's empty history")
        assert await client.chat("high", fresh) == (0, 0)
        again = await client.chat("high", fresh)
        assert again[0] == again[1] > 0, again
        assert await client.chat("high", before) == (0, 0)


async def _wait_ready(engine: EngineProcess) -> None:
    await asyncio.to_thread(engine.wait_ready)
