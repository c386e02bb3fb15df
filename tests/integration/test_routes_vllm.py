"""The model routes beyond chat and completions, through the proxy, on real vLLM (CPU build).

Two engines: the tiny Llama served for pooling (``POOLING_ARGS``) with the plugin requiring a
ticket, so every route must carry one that verifies (a direct call without one is refused), and
the shared generative engine for the Responses API, the tokenizer routes and vLLM's probes,
compared with the same calls made directly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.bench.inproc import auth, make_config, running_proxy
from proxy.tools.engine import EngineProcess
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import CORE, POOLING_TICKETED

pytestmark = [pytest.mark.integration, pytest.mark.engines(POOLING_TICKETED, CORE)]
TIMEOUT = aiohttp.ClientTimeout(total=60)

POOLING_CALLS: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {"model": "tiny", "input": ["hello world", "the fox"]},
    "/pooling": {"model": "tiny", "input": "hello world"},
    "/score": {"model": "tiny", "text_1": "hello", "text_2": ["world", "fox"]},
    "/v1/score": {"model": "tiny", "queries": "hello", "documents": ["world"]},
    "/rerank": {"model": "tiny", "query": "hello", "documents": ["world", "fox"]},
    "/v1/rerank": {"model": "tiny", "query": "hello", "documents": ["world"]},
    "/tokenize": {"model": "tiny", "prompt": "hello world"},
}


@pytest.fixture(scope="module")
def pooling(engines: EngineFarm) -> EngineProcess:
    return engines.get(POOLING_TICKETED)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        yield s


async def test_pooling_routes_carry_tickets_that_verify(
    pooling: EngineProcess, session: aiohttp.ClientSession
) -> None:
    direct = pooling.spec.url
    failed: dict[str, str] = {}  # every route tried before the test fails: all are reported
    async with running_proxy(make_config([{"url": direct}])) as (base, state):
        for path, body in POOLING_CALLS.items():
            async with session.post(direct + path, json=body) as r:
                if r.status != 401:  # the plugin lets nothing unticketed in
                    failed[path] = f"direct without a ticket: {r.status}"
            async with session.post(base + path, json=body, headers=auth("normal")) as r:
                answer = await r.json()
                if r.status != 200 or not r.headers.get("X-Request-Id"):
                    failed[path] = f"through the proxy: {r.status} {answer}"
                elif path != "/tokenize" and not answer["usage"]["prompt_tokens"] > 0:
                    failed[path] = f"no usage: {answer}"
        assert not failed
        tokens = state.metrics.tokens.labels("normal", "prompt")._value.get()
        assert tokens > 0  # usage charged from the pooling answers
        async with session.get(base + "/v1/embeddings", headers=auth("normal")) as r:
            assert r.status == 405 and r.headers["Allow"] == "POST"


async def test_responses_tokenizer_and_probes_as_direct(
    engines: EngineFarm, session: aiohttp.ClientSession
) -> None:
    direct = engines.get(CORE).spec.url
    body = {"model": "tiny", "input": "hello", "max_output_tokens": 6, "temperature": 0}
    async with running_proxy(make_config([{"url": direct}])) as (base, state):

        async def both(method: str, path: str, json: Any = None) -> list[Any]:
            out = []
            for url, headers in ((direct, {}), (base, auth("high"))):
                async with session.request(method, url + path, json=json, headers=headers) as r:
                    assert r.status == 200, (url, path, await r.text())
                    out.append(await r.read())
            return out

        plain_direct, plain_proxy = await both("POST", "/v1/responses", body)
        assert _output_text(plain_direct) == _output_text(plain_proxy)
        streamed_direct, streamed_proxy = await both(
            "POST", "/v1/responses", {**body, "stream": True}
        )
        assert _event_kinds(streamed_direct) == _event_kinds(streamed_proxy)
        assert _event_kinds(streamed_proxy)[-1] == "response.completed"
        assert state.metrics.tokens.labels("high", "completion")._value.get() > 0

        tokenized = await both("POST", "/tokenize", {"model": "tiny", "prompt": "hello"})
        assert tokenized[0] == tokenized[1]
        detok = await both("POST", "/detokenize", {"model": "tiny", "tokens": [5, 6, 7]})
        assert detok[0] == detok[1]
        health = await both("GET", "/health")
        assert health == [b"", b""]
        version = await both("GET", "/version")
        assert orjson.loads(version[0]) == orjson.loads(version[1])


def _output_text(raw: bytes) -> str:
    answer = orjson.loads(raw)
    parts = [c["text"] for item in answer["output"] for c in item.get("content") or []]
    return "".join(parts)


def _event_kinds(raw: bytes) -> list[str]:
    return [
        line.removeprefix(b"event:").strip().decode()
        for line in raw.splitlines()
        if line.startswith(b"event:")
    ]
