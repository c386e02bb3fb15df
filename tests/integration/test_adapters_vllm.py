"""LoRA adapters through the proxy against a real CPU vLLM (``--enable-lora --max-lora-rank 8
--max-loras 2``, runtime loading on, KV events): a tenant's adapter answers with other tokens
than the base model; another tenant gets the 404 of a model that does not exist and never sees
it listed; an adapter the engine does not hold is served once the proxy loaded it; with three
adapters and two slots no request waits in vLLM for a slot (its queue time); and the KV events of an adapter's blocks predict the
``cached_tokens`` of the next turn, per adapter and salt; a high-tier request for an adapter
finishes before the low tier's long generations that hold the other slots."""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.bench.inproc import auth, make_config, running_proxy, until
from proxy.policies.types import QueuedRequest
from proxy.server.state import ProxyState
from proxy.tools.engine import EngineProcess
from proxy.tools.tiny_adapters import make_tiny_adapters
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import LORA

# `long`: its own engine (LoRA on) would add a start to `make test` past its 8-minute goal;
# `make test-all` (CI) runs it.
pytestmark = [pytest.mark.integration, pytest.mark.engines(LORA), pytest.mark.long]
# What is tested is where requests wait and what they get, not how fast: on a busy 2-core host
# twelve 192-token answers behind two slots took 13-41 s each, and the last ones outlived the
# high tier's usual 60 s queue limit.
TIMEOUT = aiohttp.ClientTimeout(total=900)
SLOW_HOST_TIERS = {
    name: {"queue_timeout_s": 600, "request_timeout_s": 600} for name in ("high", "normal", "low")
}
BLOCK = 32
NAMES = ("lora-a", "lora-b", "lora-c")


@pytest.fixture(scope="module")
def engine(engines: EngineFarm) -> EngineProcess:
    return engines.get(LORA)


@pytest.fixture(scope="module")
def adapter_dirs(
    engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("adapters")
    return make_tiny_adapters(out, engine.spec.model, names=NAMES)


@asynccontextmanager
async def proxy(
    engine: EngineProcess, dirs: dict[str, Path]
) -> AsyncIterator[tuple[str, ProxyState, aiohttp.ClientSession]]:
    adapters = {
        "lora-a": {"path": str(dirs["lora-a"]), "base_model": "tiny", "tenants": ["tenant-high"]},
        "lora-b": {"path": str(dirs["lora-b"]), "base_model": "tiny", "shared": True},
        "lora-c": {"path": str(dirs["lora-c"]), "base_model": "tiny", "shared": True},
    }
    backend = {"url": engine.spec.url, "max_inflight": 4, "max_loras": 2, "load_adapters": True}
    kv = {"enabled": True, "tokenizer": engine.spec.model, "block_size": BLOCK}
    config = make_config([backend], tiers=SLOW_HOST_TIERS, adapters=adapters, kv_cache=kv)
    async with (
        running_proxy(config) as (base, state),
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
    ):
        await until(lambda: state.pool.all()[0].models is not None, 10, "/v1/models", state)
        yield base, state, session


async def _unload_everything(engine: EngineProcess) -> None:
    """The engine as at start: no adapter (an earlier test may have left some)."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for name in NAMES:
            async with session.post(
                f"{engine.spec.url}/v1/unload_lora_adapter", json={"lora_name": name}
            ) as resp:
                assert resp.status in (200, 404), await resp.text()


async def _engine_models(engine: EngineProcess) -> set[str]:
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(f"{engine.spec.url}/v1/models") as resp,
    ):
        return {card["id"] for card in (await resp.json())["data"]}


async def _complete(
    session: aiohttp.ClientSession, base: str, tier: str, model: str, **extra: Any
) -> tuple[int, dict[str, Any]]:
    body = {"model": model, "prompt": "hello world the quick brown fox", "max_tokens": 8,
            "temperature": 0, "return_token_ids": True, **extra}  # fmt: skip
    async with session.post(f"{base}/v1/completions", json=body, headers=auth(tier)) as resp:
        return resp.status, await resp.json()


async def _listed(session: aiohttp.ClientSession, base: str, tier: str) -> set[str]:
    async with session.get(f"{base}/v1/models", headers=auth(tier)) as resp:
        return {card["id"] for card in (await resp.json())["data"]}


async def test_a_tenants_adapter_answers_and_is_private(
    engine: EngineProcess, adapter_dirs: dict[str, Path]
) -> None:
    async with proxy(engine, adapter_dirs) as (base, _, session):
        status, adapted = await _complete(session, base, "high", "lora-a")
        assert status == 200, adapted
        status, plain = await _complete(session, base, "high", "tiny")
        assert status == 200, plain
        assert adapted["choices"][0]["token_ids"] != plain["choices"][0]["token_ids"]
        assert "lora-a" in await _listed(session, base, "high")
        # Another tenant: the very 404 of a model that does not exist, and it is not listed.
        theirs = await _complete(session, base, "normal", "lora-a")
        missing = await _complete(session, base, "normal", "no-such-model")
        assert theirs[0] == missing[0] == 404
        assert theirs[1]["error"]["code"] == missing[1]["error"]["code"] == "model_not_found"
        assert theirs[1]["error"]["message"] == missing[1]["error"]["message"].replace(
            "no-such-model", "lora-a"
        )
        assert "lora-a" not in await _listed(session, base, "normal")
        assert {"lora-b", "lora-c"} <= await _listed(session, base, "normal")


async def test_an_adapter_the_engine_lacks_is_served_once_the_proxy_loaded_it(
    engine: EngineProcess, adapter_dirs: dict[str, Path]
) -> None:
    await _unload_everything(engine)
    assert "lora-b" not in await _engine_models(engine)
    async with proxy(engine, adapter_dirs) as (base, state, session):
        status, body = await _complete(session, base, "normal", "lora-b")
        assert status == 200, body
        assert "lora-b" in await _engine_models(engine)
        loads = state.metrics.adapters.loads.labels(engine.spec.url, "lora-b")._value.get()
        assert loads == 1


_QUEUE_SUM = re.compile(r"^vllm:request_queue_time_seconds_sum(?:\{[^}]*\})? (\S+)$", re.MULTILINE)


def _queue_seconds(metrics: str) -> float:
    """The seconds requests spent waiting in vLLM's scheduler, all together (its histogram's
    sum: no bucket floor, which a fast machine's short requests fell below)."""
    found = [float(m[1]) for m in _QUEUE_SUM.finditer(metrics)]
    assert found, "vLLM reports no request_queue_time_seconds_sum"
    return sum(found)


async def _engine_metrics(session: aiohttp.ClientSession, engine: EngineProcess) -> str:
    async with session.get(f"{engine.spec.url}/metrics") as resp:
        return await resp.text()


async def test_never_more_distinct_adapters_in_the_engine_than_its_slots(
    engine: EngineProcess, adapter_dirs: dict[str, Path]
) -> None:
    """Three adapters, two slots, twelve requests four at a time: a third distinct adapter
    sent to vLLM would wait in its scheduler ("deferred") for a whole generation of another
    adapter; the proxy holds it in its own queue instead. vLLM's own queue time shows whether
    the requests waited there, all together, for as long as half the shortest request took."""
    await _unload_everything(engine)
    async with proxy(engine, adapter_dirs) as (base, state, session):
        backend = state.pool.all()[0]
        distinct: list[int] = []
        done = asyncio.Event()

        async def watch() -> None:  # the proxy's own count, at every step of the loop
            while not done.is_set():
                distinct.append(len(backend.adapters.running()))
                await asyncio.sleep(0.01)

        async def timed(name: str) -> tuple[int, float]:
            started = asyncio.get_running_loop().time()
            status, _ = await _complete(
                session, base, "high", name, max_tokens=512, ignore_eos=True
            )
            return status, asyncio.get_running_loop().time() - started

        before = _queue_seconds(await _engine_metrics(session, engine))
        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*(timed(n) for n in NAMES * 4))
        done.set()
        await watcher
        waited = _queue_seconds(await _engine_metrics(session, engine)) - before
        assert [status for status, _ in results] == [200] * 12, results
        assert max(distinct) == 2  # two adapters ran together, never three
        shortest = min(seconds for _, seconds in results)
        # One deferred request alone would wait about a generation; all twelve together
        # waited a step or so each.
        assert waited < shortest / 2, f"requests waited {waited:.3f}s inside vLLM ({shortest=})"
        unloads = sum(
            state.metrics.adapters.unloads.labels(engine.spec.url, n)._value.get() for n in NAMES
        )
        assert unloads >= 1  # the third adapter took the place of an idle one


async def test_adapter_kv_events_predict_the_next_turns_cached_tokens(
    engine: EngineProcess, adapter_dirs: dict[str, Path]
) -> None:
    async with proxy(engine, adapter_dirs) as (base, state, session):
        backend = state.pool.all()[0]
        await until(lambda: backend.kv_index is not None and backend.kv_index.warm(), 20,
                    "a warm index", state)  # fmt: skip
        queued: list[QueuedRequest] = []
        inner = state.pipeline.dispatcher.enqueue

        def enqueue(request: QueuedRequest, **kw: Any) -> Any:
            queued.append(request)
            return inner(request, **kw)

        state.pipeline.dispatcher.enqueue = enqueue  # type: ignore[method-assign,assignment]
        system = f"{secrets.token_hex(8)} " + " ".join(f"rule{i % 89}" for i in range(150))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]

        async def turn(tier: str, model: str) -> tuple[int, int]:
            body = {"model": model, "messages": messages, "max_tokens": 1}
            url = f"{base}/v1/chat/completions"
            async with session.post(url, json=body, headers=auth(tier)) as resp:
                assert resp.status == 200, await resp.text()
                usage = (await resp.json())["usage"]
            request = queued[-1]
            blocks = request.prompt_blocks
            assert blocks, "no prompt blocks computed"
            await until(lambda: backend.cached_blocks(blocks) == len(blocks), 10, "its blocks")
            predicted = (request.predicted_blocks or 0) * BLOCK
            return predicted, usage["prompt_tokens_details"]["cached_tokens"]

        first = await turn("high", "lora-c")
        assert first == (0, 0)
        predicted, cached = await turn("high", "lora-c")  # the same adapter and salt
        assert cached > 0 and predicted == cached
        # Another tenant (salt) on the same adapter, and the base model: neither hits.
        assert await turn("normal", "lora-c") == (0, 0)
        assert await turn("high", "tiny") == (0, 0)
        messages.append({"role": "assistant", "content": "ok " * 40})
        messages.append({"role": "user", "content": "and the next turn " * 4})
        predicted, cached = await turn("high", "lora-c")  # the next turn of the conversation
        assert cached > 0 and predicted == cached


async def test_a_failed_load_is_refused_clearly_and_counted(
    engine: EngineProcess, adapter_dirs: dict[str, Path]
) -> None:
    await _unload_everything(engine)
    broken = {**adapter_dirs, "lora-b": Path("/nonexistent/lora-b")}
    async with proxy(engine, broken) as (base, state, session):
        status, body = await _complete(session, base, "normal", "lora-b")
        assert status == 503, body
        assert body["error"]["code"] == "adapter_load_failed"
        assert "lora-b" in body["error"]["message"]
        failures = state.metrics.adapters.load_failures.labels(engine.spec.url, "lora-b")
        assert failures._value.get() == 1
        status, body = await _complete(session, base, "normal", "lora-c")  # the engine serves on
        assert status == 200, body


async def test_a_high_tier_adapter_does_not_wait_behind_low_tier_generations(
    engine: EngineProcess, adapter_dirs: dict[str, Path]
) -> None:
    """The red team's run on this engine: a 2-token high-tier request for a third adapter,
    sent while the low tier runs two 250-token generations on the two other adapters, waited
    until one of them ended (18 s). With the best tier's reserve of adapter slots the low
    tier's second adapter waits in the proxy's queue and the high request finishes first."""
    await _unload_everything(engine)
    async with proxy(engine, adapter_dirs) as (base, state, session):
        loop = asyncio.get_running_loop()
        began = loop.time()

        async def timed(tier: str, model: str, max_tokens: int) -> float:
            status, body = await _complete(
                session, base, tier, model, max_tokens=max_tokens, ignore_eos=True
            )
            assert status == 200, body
            return loop.time() - began

        lows = [asyncio.create_task(timed("low", n, 250)) for n in ("lora-b", "lora-c")]
        running = state.pool.all()[0].adapters.running
        await until(lambda: bool(running()), 60, "a low generation", state)
        sent = loop.time() - began
        high = await timed("high", "lora-a", 2)
        ends = await asyncio.gather(*lows)
        print(f"high sent {sent:.2f} s, done {high:.2f} s; low ends {ends}")  # figures, with -s
        assert high < min(ends), (high, ends)  # in steps: before either low generation ended
