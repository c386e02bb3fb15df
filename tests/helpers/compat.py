"""What the compatibility tests share: the engine they use, clients for both sides, and
comparisons of answers that ignore only what differs between any two calls (ids, times)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import openai
import prometheus_client

from proxy.bench.inproc import KEYS, make_config, running_proxy
from proxy.server.state import ProxyState
from proxy.telemetry import prometheus
from proxy.tools.engine import EngineProcess
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import LONG_CONTEXT
from tests.helpers.paths import TINY_MODEL_DIR

MODEL = "tiny"
TOKENIZER_DIR = TINY_MODEL_DIR
# Fields whose values differ between any two calls, whoever serves them.
VOLATILE = frozenset({"id", "created", "created_at", "system_fingerprint"})


def engine(engines: EngineFarm) -> EngineProcess:
    """The engine the compatibility tests share with tests/integration/test_proxy_core.py."""
    return engines.get(LONG_CONTEXT)


@dataclass
class Sides:
    """The proxy and vLLM itself, each with its base URL and API key."""

    proxy: str
    direct: str
    state: ProxyState
    key: str = KEYS["high"]

    def pairs(self) -> list[tuple[str, str, str]]:
        """(side, base URL of the OpenAI API, key): first the proxy, then vLLM directly."""
        return [("proxy", f"{self.proxy}/v1", self.key), ("direct", f"{self.direct}/v1", "none")]

    def sync_clients(self, **options: Any) -> dict[str, openai.OpenAI]:
        return {
            side: openai.OpenAI(base_url=url, api_key=key, timeout=60, **options)
            for side, url, key in self.pairs()
        }

    def async_clients(self, **options: Any) -> dict[str, openai.AsyncOpenAI]:
        return {
            side: openai.AsyncOpenAI(base_url=url, api_key=key, timeout=60, **options)
            for side, url, key in self.pairs()
        }


@contextlib.asynccontextmanager
async def sides(
    engine: EngineProcess, max_inflight: int = 4, **config: Any
) -> AsyncIterator[Sides]:
    cfg = make_config([{"url": engine.spec.url, "max_inflight": max_inflight}], **config)
    async with running_proxy(cfg) as (base, state):
        yield Sides(proxy=base, direct=engine.spec.url, state=state)


def finished_requests(state: ProxyState) -> float:
    """Requests the proxy has finished (any outcome): each attempt of a retrying client."""
    text = prometheus_client.generate_latest(state.metrics.registry).decode()
    return prometheus.total(text, "tierproxy_requests_total")


def shape(value: Any, prefix: str = "") -> set[str]:
    """The paths of every field that is set (not null), list items merged: what a client can
    read from an answer, whatever the values."""
    paths: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            if item is None:
                continue
            path = f"{prefix}.{key}" if prefix else key
            paths.add(path)
            paths |= shape(item, path)
    elif isinstance(value, list):
        for item in value:
            paths |= shape(item, f"{prefix}[]")
    return paths


def without_volatile(value: Any) -> Any:
    """The answer with ids and timestamps taken out, for comparing values."""
    if isinstance(value, dict):
        return {k: without_volatile(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [without_volatile(v) for v in value]
    return value


def dump(model: Any) -> dict[str, Any]:
    data: dict[str, Any] = model.model_dump(mode="json", exclude_unset=True)
    return data


@dataclass
class StreamSummary:
    """What a client reads from a stream: text and finish reason per choice, usage, fields."""

    text: dict[int, str]
    finish: dict[int, str | None]
    usage: dict[str, Any] | None
    fields: set[str]
    chunks_with_usage: int


def summarize_chunks(chunks: Iterable[Any]) -> StreamSummary:
    text: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage: dict[str, Any] | None = None
    fields: set[str] = set()
    with_usage = 0
    for chunk in chunks:
        data = dump(chunk)
        fields |= shape(data)
        for choice in data.get("choices", []):
            index = choice["index"]
            piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            text[index] = text.get(index, "") + piece
            if choice.get("finish_reason"):
                finish[index] = choice["finish_reason"]
        if data.get("usage"):
            usage = data["usage"]
            with_usage += 1
    return StreamSummary(text, finish, usage, fields, with_usage)
