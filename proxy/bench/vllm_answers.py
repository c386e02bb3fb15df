"""vLLM 0.32's answers in their wire shapes, built once: what the fake vLLM
(``proxy.bench.fake_vllm``) answers and ``benchmarks/nullserver.py`` writes on its raw wire."""

from __future__ import annotations

from typing import Any

import orjson


def usage_of(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def chat_completion(
    model: str,
    content: str,
    usage: dict[str, int],
    *,
    finish_reason: str = "stop",
    id_: str = "chatcmpl-fake",
) -> bytes:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": content},
        "finish_reason": finish_reason,
    }
    body = {
        "id": id_,
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }
    return orjson.dumps(body)


def chat_chunk(
    model: str, choices: list[dict[str, Any]], *, id_: str = "chatcmpl-fake", **extra: Any
) -> bytes:
    """One SSE event of a streamed chat answer, as vLLM writes it."""
    body = {
        "id": id_,
        "object": "chat.completion.chunk",
        "created": 1,
        "model": model,
        "choices": choices,
        **extra,
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


def models_list(model: str, max_model_len: int = 2048) -> bytes:
    card = {"id": model, "object": "model", "root": model, "parent": None}
    return orjson.dumps({"object": "list", "data": [{**card, "max_model_len": max_model_len}]})


DONE = b"data: [DONE]\n\n"

# The overhead benchmark's fixed answers (benchmarks/nullserver.py writes them on a raw wire,
# benchmarks/overhead.py has nginx serve them as files): a stream of 60 token events.
NULL_MODEL = "null-model"
NULL_EVENTS = 60
NULL_USAGE = usage_of(12, NULL_EVENTS)


def null_stream_events() -> list[bytes]:
    """The events of one streamed answer as vLLM writes them with include_usage: the role, the
    content events, the finish, the usage chunk and [DONE]."""
    delta = {"index": 0, "logprobs": None, "finish_reason": None}
    events = [
        chat_chunk(
            NULL_MODEL,
            [{**delta, "delta": {"role": "assistant", "content": ""}}],
            id_="chatcmpl-null",
        )
    ]
    events += [
        chat_chunk(NULL_MODEL, [{**delta, "delta": {"content": f" t{i}"}}], id_="chatcmpl-null")
        for i in range(NULL_EVENTS - 1)
    ]
    finish = {**delta, "delta": {"content": ""}, "finish_reason": "length"}
    events.append(chat_chunk(NULL_MODEL, [finish], id_="chatcmpl-null"))
    events.append(chat_chunk(NULL_MODEL, [], id_="chatcmpl-null", usage=NULL_USAGE))
    events.append(DONE)
    return events


def null_completion() -> bytes:
    return chat_completion(
        NULL_MODEL, "null " * 16, NULL_USAGE, finish_reason="length", id_="chatcmpl-null"
    )


def generation(path: str, model: str, usage: dict[str, int], pad_bytes: int) -> bytes:
    """A non-stream chat or completions answer; ``pad_bytes``: a client-sized logprobs tail
    (as a completions answer) before its usage."""
    if path == "/v1/chat/completions" and not pad_bytes:
        return chat_completion(model, "ok", usage)
    choice: dict[str, Any] = {"index": 0, "text": "ok", "finish_reason": "stop"}
    if pad_bytes:  # a client-sized logprobs tail, before usage (completions' order)
        entries = pad_bytes // 11 + 1  # ~11 bytes an entry
        choice["logprobs"] = {"tokens": ["tok"] * entries, "token_logprobs": [-1.5] * entries}
    return orjson.dumps(
        {
            "id": "cmpl-fake",
            "object": "text_completion",
            "created": 1,
            "model": model,
            "choices": [choice],
            "usage": usage,
        }
    )


def responses_usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "input_tokens": prompt,
        "output_tokens": completion,
        "total_tokens": prompt + completion,
    }


def responses_event(kind: str, data: dict[str, Any]) -> bytes:
    """One event of a Responses stream (typed, unlike chat's ``data:`` lines)."""
    return f"event: {kind}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"


# vLLM's answer once its engine core died (EngineDeadError): a 500 to this request and every
# later one, until the process is restarted.
ENGINE_DEAD = orjson.dumps(
    {
        "error": {
            "message": "EngineCore encountered an issue."
            " See stack trace (above) for the root cause.",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
)
# ~64 KiB of histogram lines: what a broken exporter pads /metrics with.
METRICS_PADDING = b'vllm:histogram_bucket{engine="0",le="0.5"} 1\n' * 1400
