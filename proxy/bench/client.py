"""One streaming OpenAI chat completion, timed chunk by chunk, classified into an outcome."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from proxy.bench.records import Outcome, PlannedRequest, RequestRecord
from proxy.relay import sse


@dataclass(frozen=True)
class ClientSettings:
    base_url: str  # http://127.0.0.1:8000 (no /v1)
    model: str
    t0: float  # time.monotonic() of the run's start; records hold offsets from it
    request_timeout_s: float = 180.0  # the whole request, queueing included
    connect_timeout_s: float = 10.0
    run_id: str = "bench"


def request_body(planned: PlannedRequest, model: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": planned.prompt}],
        "max_tokens": planned.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Lengths are part of the scenario: generate exactly max_tokens tokens.
        "ignore_eos": True,
        "temperature": 0.0,
    }


def _status_outcome(status: int) -> Outcome:
    if status == 429:
        return Outcome.RATE_LIMITED
    if status == 503:
        return Outcome.UNAVAILABLE
    if status == 504:
        return Outcome.TIMEOUT
    return Outcome.ERROR


def _error_event_outcome(error: Any) -> Outcome:
    """An error event inside a stream: a timeout (the proxy's 504) or some other error."""
    if isinstance(error, dict):
        code = str(error.get("code", ""))
        text = f"{error.get('type', '')} {error.get('message', '')}".lower()
        if code == "504" or "timeout" in text or "timed out" in text:
            return Outcome.TIMEOUT
        if code in ("503", "429"):
            return Outcome(code)
    return Outcome.ERROR


async def send(
    session: aiohttp.ClientSession, planned: PlannedRequest, settings: ClientSettings
) -> RequestRecord:
    """Send one request and time it; never raises except on cancellation."""
    rec = RequestRecord(
        index=planned.index, tenant=planned.tenant, tier=planned.tier, scheduled=planned.at
    )

    def now() -> float:
        return time.monotonic() - settings.t0

    headers = {
        "Authorization": f"Bearer {planned.key}",
        "Content-Type": "application/json",
        "X-Request-Id": f"{settings.run_id}-{planned.index}",
    }
    timeout = aiohttp.ClientTimeout(
        total=settings.request_timeout_s, sock_connect=settings.connect_timeout_s
    )
    url = f"{settings.base_url}/v1/chat/completions"
    rec.sent = now()
    try:
        # The outer bound also covers awaits aiohttp's own timeout does not watch.
        async with asyncio.timeout(settings.request_timeout_s + 5.0):
            async with session.post(
                url,
                data=orjson.dumps(request_body(planned, settings.model)),
                headers=headers,
                timeout=timeout,
            ) as resp:
                rec.status = resp.status
                if resp.status != 200:
                    body = await resp.content.read(1024)
                    rec.end = now()
                    rec.outcome = _status_outcome(resp.status)
                    rec.error = body.decode("utf-8", "replace")[:300]
                    return rec
                await _read_stream(resp, rec, now)
    except aiohttp.ConnectionTimeoutError:
        # Never accepted (e.g. the server's listen backlog overflowed): a definitive failure,
        # the request did not reach the server. Checked before TimeoutError, its base class.
        rec.end = now()
        rec.outcome = Outcome.ERROR
        rec.error = f"connect timeout: not accepted within {settings.connect_timeout_s:g}s"
    except TimeoutError:
        rec.outcome = Outcome.LOST
        where = "before a status" if rec.status is None else "mid-stream"
        rec.error = f"no answer within {settings.request_timeout_s:g}s ({where})"
    except aiohttp.ClientConnectorError as exc:
        rec.end = now()
        rec.outcome = Outcome.ERROR
        rec.error = f"cannot connect: {exc}"
    except (aiohttp.ClientError, ValueError) as exc:
        # The connection dropped or the stream broke before a definitive answer.
        rec.outcome = Outcome.LOST
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


async def _read_stream(
    resp: aiohttp.ClientResponse, rec: RequestRecord, now: Callable[[], float]
) -> None:
    done = False
    outcome = Outcome.OK
    async for payload in sse.data_of(resp):
        if payload.strip() == sse.DONE:
            done = True
            break
        event = orjson.loads(payload)
        if "error" in event:
            outcome = _error_event_outcome(event["error"])
            rec.error = orjson.dumps(event["error"]).decode()[:300]
            continue
        usage = event.get("usage")
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.output_tokens = usage.get("completion_tokens")
        if event.get("choices"):
            # As `vllm bench serve` counts: every chunk with choices is a token event, the
            # first one (vLLM sends the role with the first token) is the first token.
            # Counting only non-empty text would miss tokens that decode to "" on their own.
            t = now()
            if rec.first_token is None:
                rec.first_token = t
            rec.token_times.append(t)
    rec.end = now()
    if not done and outcome is Outcome.OK:
        rec.outcome = Outcome.LOST
        rec.error = rec.error or "stream ended without [DONE]"
        return
    rec.outcome = outcome
