"""A stream ends at its ``[DONE]`` event on `tierproxy serve` (uvloop, the C parser), in front of
backends that misbehave at it: events written after ``[DONE]`` in the same write reach no client
and a usage chunk among them is not billed (the usage log), and the terminal chunk the relay
holds for the usage chunk's fingerprint comes before ``[DONE]`` when no usage chunk comes
(vLLM's n=2 stream whose choice 1 fails after choice 0 finished). The in-process twin:
tests/adversarial/test_stream_done.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import exchange, json_request
from proxy.bench.hostile.served import NullBackend, StartServed
from proxy.bench.inproc import KEYS

DONE = b"data: [DONE]\n\n"


def event(data: object) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def choice(index: int, text: str | None, finish: str | None = None) -> bytes:
    delta = {"content": text} if text is not None else {}
    chunk = {"index": index, "delta": delta, "finish_reason": finish}
    return event({"object": "chat.completion.chunk", "choices": [chunk]})


def usage(completion: int) -> bytes:
    counts = {"prompt_tokens": 3, "completion_tokens": completion, "total_tokens": 3 + completion}
    return event({"choices": [], "usage": counts, "system_fingerprint": "fp"})


ERROR = event({"error": {"message": "boom", "type": "InternalServerError", "code": 500}})
# The body's ``user`` chooses the answer, each part one write.
ANSWERS = {
    "after_done": [
        choice(0, "a") + choice(0, "b"),
        choice(0, None, "stop") + usage(2),
        DONE + choice(0, "AFTER") + usage(100_000),
    ],
    "n2_error": [
        choice(0, "a") + choice(1, "b"),
        choice(0, None, "stop"),
        choice(1, "c"),
        ERROR,
        DONE,
    ],
}


async def answer(request: web.Request, n: int) -> web.StreamResponse:
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for part in ANSWERS[body["user"]]:
        await resp.write(part)
    await resp.write_eof()
    return resp


@pytest.fixture(scope="module")
def backend() -> Iterator[NullBackend]:
    """This module's fake backend (the served fixtures forward to it)."""
    with NullBackend(FakeVLLM(script=answer)) as upstream:
        yield upstream


def chat(user: str, n: int = 1) -> bytes:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "n": n,
        "user": user,
    }
    return json_request("/v1/chat/completions", body, KEYS["normal"])


async def usage_record(log: Path) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while not (log.exists() and log.read_text().strip()):
        assert time.monotonic() < deadline, "no usage-log line"
        await asyncio.sleep(0.05)
    (line,) = log.read_text().splitlines()
    record: dict[str, Any] = orjson.loads(line)
    return record


async def test_served_events_after_done_reach_no_client_and_are_not_billed(
    start_served: StartServed, tmp_path: Path
) -> None:
    # Before: the client got the AFTER token and [DONE] was not its last event; the usage log
    # billed 100,000 completion tokens for 2 generated.
    log = tmp_path / "usage.jsonl"
    proxy = start_served(usage_log={"path": str(log)})
    resp = await exchange(proxy.host, proxy.port, chat("after_done"))
    assert resp.status == 200
    assert resp.body.endswith(DONE) and b"AFTER" not in resp.body, resp.body[-300:]
    record = await usage_record(log)
    assert (record["outcome"], record["completion_tokens"]) == ("ok", 2)
    assert record["usage_estimated"] is False


async def test_served_held_terminal_chunk_comes_before_done_without_usage(
    start_served: StartServed,
) -> None:
    # Before: choice 0's finish_reason came after [DONE], where an OpenAI SDK stops reading.
    proxy = start_served()
    resp = await exchange(proxy.host, proxy.port, chat("n2_error", n=2))
    assert resp.status == 200
    before, _, after = resp.body.partition(b"data: [DONE]")
    assert b'"finish_reason":"stop"' in before and after.strip() == b"", resp.body
    assert before.index(b'"finish_reason":"stop"') > before.index(b'"error"')
