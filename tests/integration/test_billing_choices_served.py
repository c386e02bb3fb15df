"""What a request makes vLLM run is what it is billed, against ``tierproxy serve`` (a
subprocess) in front of a real CPU vLLM, counted by the engine's own counters (red team, stop
57): every choice of an ``n`` > 1 request prefills its prompt (vLLM counts it once per choice,
its usage once: 64 choices ran 33x a tenant's quota); a stream whose client asked vLLM to
hold its tokens back (``stream_interval``) and left meanwhile was billed the one chunk it got
(1,800 tokens run for a bill of 3); and a stream with logprobs of tokens that make no text,
whose chunks carried many steps each, was billed about one token a chunk."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.bench.hostile.served import ServedProxy, admin_sections
from proxy.bench.inproc import KEYS, make_config
from proxy.config.tenants import hash_key
from proxy.telemetry.prometheus import total
from proxy.tools.engine import EngineProcess
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import PROMPT_DETAILS

pytestmark = [pytest.mark.integration, pytest.mark.engines(PROMPT_DETAILS)]
TIMEOUT = aiohttp.ClientTimeout(total=180)
HEADERS = {"Authorization": f"Bearer {KEYS['normal']}"}
POLLS = 600  # of 50 ms: what the engine is waited for, counted


@pytest.fixture(scope="module")
def engine(engines: EngineFarm) -> EngineProcess:
    return engines.get(PROMPT_DETAILS)


def _served(engine: EngineProcess, tmp_path: Path) -> tuple[dict[str, Any], Path]:
    tenants = [{"name": "alice", "tier": "normal", "keys": [{"sha256": hash_key(KEYS["normal"])}]}]
    config = make_config([{"url": engine.spec.url}], tenants=tenants, **admin_sections())
    usage_log = tmp_path / "usage.jsonl"
    config["usage_log"] = {"path": str(usage_log)}
    return config, usage_log


async def _engine(session: aiohttp.ClientSession, engine: EngineProcess) -> dict[str, float]:
    async with session.get(engine.spec.url + "/metrics") as r:
        text = await r.text()
    return {
        name: total(text, f"vllm:{name}")
        for name in ("prompt_tokens_total", "generation_tokens_total", "num_requests_running")
    }


async def _settled(session: aiohttp.ClientSession, engine: EngineProcess) -> dict[str, float]:
    """The engine's counters once it runs nothing."""
    for _ in range(POLLS):
        counts = await _engine(session, engine)
        if counts["num_requests_running"] == 0:
            return counts
        await asyncio.sleep(0.05)
    raise AssertionError("the engine still runs the request")


async def _record(usage_log: Path) -> dict[str, Any]:
    for _ in range(POLLS):
        if usage_log.exists() and (lines := usage_log.read_bytes().splitlines()):
            record: dict[str, Any] = orjson.loads(lines[-1])
            return record
        await asyncio.sleep(0.05)
    raise AssertionError("no usage record written")


async def test_each_choice_of_n_is_billed_the_prompt_it_prefilled(
    engine: EngineProcess, tmp_path: Path
) -> None:
    config, usage_log = _served(engine, tmp_path)
    prompt = " ".join(f"word{i}" for i in range(120))
    body = {"model": "tiny", "prompt": prompt, "n": 4, "max_tokens": 1}
    with ServedProxy(config, tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            before = await _settled(session, engine)
            async with session.post(proxy.url + "/v1/completions", json=body, headers=HEADERS) as r:
                assert r.status == 200, await r.text()
                usage = (await r.json())["usage"]
            ran = (await _settled(session, engine))["prompt_tokens_total"]
            record = await _record(usage_log)
    ran -= before["prompt_tokens_total"]
    assert ran == 4 * usage["prompt_tokens"], "vLLM prefills the prompt once per choice"
    assert record["prompt_tokens"] == ran, f"billed {record['prompt_tokens']} of {ran} prefilled"


async def test_a_stream_cut_while_vllm_would_hold_its_tokens_back_is_billed_what_ran(
    engine: EngineProcess, tmp_path: Path
) -> None:
    """The client reads the first chunk, waits until the engine has decoded a hundred tokens
    of its answer (counted on the engine), and leaves."""
    config, usage_log = _served(engine, tmp_path)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 1_800, "ignore_eos": True, "stream_interval": 100_000}  # fmt: skip
    with ServedProxy(config, tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            before = await _settled(session, engine)
            url = proxy.url + "/v1/chat/completions"
            async with session.post(url, json=body, headers=HEADERS) as r:
                assert r.status == 200, await r.text()
                while b'"content"' not in (line := await r.content.readline()):
                    assert line, "the stream ended before its first token"
                for _ in range(POLLS):
                    now = await _engine(session, engine)
                    if now["generation_tokens_total"] - before["generation_tokens_total"] >= 100:
                        break
                    await asyncio.sleep(0.05)
                r.close()  # the client leaves mid-answer
            after = await _settled(session, engine)
            record = await _record(usage_log)
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    assert 100 <= generated < 1_800, f"the cut came at {generated} tokens"
    assert record["completion_tokens"] >= generated, (
        f"billed {record['completion_tokens']} of {generated} generated"
    )


async def test_a_stream_with_logprobs_cut_midway_is_billed_its_reservation(
    engine: EngineProcess, tmp_path: Path
) -> None:
    """Its tokens make no text (token 3, ``<pad>``, skipped), and its chunks may each carry many
    engine steps: neither text nor chunks bound them."""
    config, usage_log = _served(engine, tmp_path)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 300, "ignore_eos": True, "allowed_token_ids": [3], "logprobs": True,
            "top_logprobs": 5}  # fmt: skip
    with ServedProxy(config, tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            before = await _settled(session, engine)
            url = proxy.url + "/v1/chat/completions"
            async with session.post(url, json=body, headers=HEADERS) as r:
                assert r.status == 200, await r.text()
                for _ in range(20):  # a few of its chunks, then the client leaves
                    assert await r.content.readline(), "the stream ended before the cut"
            after = await _settled(session, engine)
            record = await _record(usage_log)
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    assert record["usage_basis"] == "reservation", record
    assert record["completion_tokens"] == 300 >= generated
