"""Requests to one vLLM OpenAI server as the proxy would send them: signed tickets, exact
token-id prompts, streamed or not, timed by the client and by vLLM's per-request metrics.

Prompts are lists of token ids, so lengths are exact and no two prompts share a prefix (vLLM's
prefix cache would otherwise make repeated prompts free).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from proxy.relay import sse
from proxy.ticket import (
    DEFAULT_PREFILL_SHARE,
    REQUEST_ID_HEADER,
    TICKET_HEADER,
    Ticket,
    body_digest,
    encode_ticket,
    new_nonce,
)

MODEL = "tiny"
VOCAB = 1024  # the tiny model's vocabulary
HIGH_PRIORITY, LOW_PRIORITY = 0, 10  # the example config's best and worst tiers

# Fine ITL buckets, 0.5 ms .. 2 s: vLLM's defaults start at 10 ms, coarser than a CPU step.
ITL_BUCKETS: list[float] = [round(0.0005 * 1.25**i, 6) for i in range(38)]

# Low-tier answers as long as --max-model-len allows (16-token prompts): the four of them must
# still be running when the high-tier request arrives, however late this client gets the CPU.
LOW_TOKENS = 4000

# Settings shared by the stock and the plugin engine, so that only the plugin differs.
# Latencies are read from vLLM itself (engine-core timestamps: per-request metrics and the ITL
# histogram), not from this client: on a loaded 2-core machine a client reads SSE late and in
# bursts, which would blur exactly the step times being compared.
ENGINE_ARGS: tuple[str, ...] = (
    "--max-model-len",
    "4096",  # the tiny model's max_position_embeddings: low-tier answers can be long
    "--max-num-batched-tokens",
    "4096",  # a whole long prompt fits one step: what stock vLLM does to decoders beside it
    "--enable-per-request-metrics",
    "--custom-histogram-buckets",
    orjson.dumps({"inter_token_latency": ITL_BUCKETS}).decode(),
)


class TicketHeaders(dict[str, str]):
    """Headers carrying a ticket; ``for_body`` signs one bound to the exact body sent (v2
    tickets are bound to body, request id and a nonce). As a plain dict it holds a ticket
    signed over an empty body, which the plugin refuses for any real request."""

    def __init__(self, secret: bytes, fields: dict[str, Any]) -> None:
        self.secret = secret
        self.fields = fields
        super().__init__(self.for_body(b""))

    def for_body(self, body: bytes) -> dict[str, str]:
        request_id = f"{self.fields['tier']}-{random.getrandbits(32):08x}"
        ticket = Ticket(
            **self.fields,
            request_id=request_id,
            body_sha256=body_digest(body),
            issued_at=time.time(),
            nonce=new_nonce(),
        )
        return {
            TICKET_HEADER: encode_ticket(ticket, self.secret),
            REQUEST_ID_HEADER: request_id,
            "Content-Type": "application/json",
        }


def ticket_headers(
    secret: bytes,
    *,
    tier: str,
    priority: int,
    deadline_s: float = 300.0,
    prefill_share: float = 1.0,
    budget: int = 4096,
) -> TicketHeaders:
    fields = {
        "tier": tier,
        "priority": priority,
        "tenant": "bench",
        "deadline": time.time() + deadline_s,
        "prefill_share": prefill_share,
        "budget": budget,
    }
    return TicketHeaders(secret, fields)


def signed(headers: dict[str, str] | None, body: bytes) -> dict[str, str] | None:
    """The headers to send with ``body``: a fresh ticket bound to it where one was asked for."""
    if isinstance(headers, TicketHeaders):
        return headers.for_body(body)
    if headers is None:
        return {"Content-Type": "application/json"}
    return {"Content-Type": "application/json", **headers}


def high(secret: bytes, **kw: Any) -> TicketHeaders:
    return ticket_headers(secret, tier="high", priority=HIGH_PRIORITY, prefill_share=1.0, **kw)


def low(secret: bytes, **kw: Any) -> TicketHeaders:
    return ticket_headers(
        secret, tier="low", priority=LOW_PRIORITY, prefill_share=DEFAULT_PREFILL_SHARE, **kw
    )


# Unseeded: a rerun against the same engine must not hit its prefix cache.
_rng = random.Random()


def token_prompt(length: int) -> list[int]:
    return [_rng.randrange(3, VOCAB) for _ in range(length)]


@dataclass
class StreamResult:
    status: int
    sent_at: float
    token_times: list[float] = field(default_factory=list)
    done_at: float = 0.0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: Any = None
    done_marker: bool = False  # saw `data: [DONE]`: the stream ended properly
    metrics: dict[str, Any] = field(default_factory=dict)  # vLLM's per-request metrics

    @property
    def server_ttft(self) -> float:
        """Queued to first token, in seconds, by the engine's own clock."""
        queue_ms = self.metrics.get("queue_time_ms") or 0.0
        ttft_ms = self.metrics.get("time_to_first_token_ms")
        if ttft_ms is None:
            raise AssertionError(f"no per-request metrics (status {self.status}, {self.error})")
        return float(queue_ms + ttft_ms) / 1000

    @property
    def ttft(self) -> float:
        if not self.token_times:
            raise AssertionError(f"no token received (status {self.status}, {self.error})")
        return self.token_times[0] - self.sent_at

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    *,
    prompt: list[int] | str,
    max_tokens: int,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
    started: asyncio.Event | None = None,
) -> StreamResult:
    """POST /v1/completions with stream=true; one timestamp per content chunk."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(extra or {})
    result = StreamResult(status=0, sent_at=time.perf_counter())
    data = orjson.dumps(body)
    async with session.post(
        f"{url}/v1/completions", data=data, headers=signed(headers, data)
    ) as resp:
        result.status = resp.status
        if resp.status != 200:
            result.error = await resp.text()
            result.done_at = time.perf_counter()
            return result
        async for data in sse.data_of(resp):
            if data.strip() == sse.DONE:
                result.done_marker = True
                break
            chunk = orjson.loads(data)
            if "error" in chunk:
                result.error = chunk["error"]
                continue
            if chunk.get("usage"):
                result.completion_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("metrics"):
                result.metrics = chunk["metrics"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    result.token_times.append(time.perf_counter())
                    if started is not None:
                        started.set()
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
    result.done_at = time.perf_counter()
    return result


@dataclass
class Completion:
    """A non-streaming answer: what the client finally got."""

    status: int
    body: dict[str, Any]
    done_at: float

    @property
    def finish_reason(self) -> str | None:
        choices = self.body.get("choices") or [{}]
        reason = choices[0].get("finish_reason")
        return str(reason) if reason is not None else None

    @property
    def completion_tokens(self) -> int | None:
        usage = self.body.get("usage") or {}
        value = usage.get("completion_tokens")
        return int(value) if value is not None else None

    @property
    def queue_time(self) -> float:
        return float((self.body.get("metrics") or {}).get("queue_time_ms") or 0.0) / 1000


async def complete(
    session: aiohttp.ClientSession,
    url: str,
    *,
    prompt: list[int] | str,
    max_tokens: int,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> Completion:
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    body.update(extra or {})
    data = orjson.dumps(body)
    async with session.post(
        f"{url}/v1/completions", data=data, headers=signed(headers, data)
    ) as resp:
        payload = await resp.json(content_type=None)
        return Completion(status=resp.status, body=payload, done_at=time.perf_counter())


def new_session() -> aiohttp.ClientSession:
    """One connection per request: a pooled keep-alive connection that uvicorn closes (its 5 s
    idle timeout, easily reached by a starved server) as a request goes out on it would fail
    that request with "Server disconnected"."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=300),
        connector=aiohttp.TCPConnector(force_close=True),
    )
