"""The ``usage`` of a JSON answer too large to hold, found while it streams through.

vLLM does not write ``usage`` last: ``ChatCompletionResponse`` serialises it before
``prompt_logprobs``, ``prompt_token_ids`` and ``kv_transfer_params``, ``ResponsesResponse``
before ``input_messages``/``output_messages`` (vllm/entrypoints/openai/*/protocol.py), and a
client chooses those fields' size. So every chunk is searched (``bytes.find``, in C), with the
last few KiB of the previous one searched again in case the object spans two reads, until it is
found; then the search stops.
The first ``"usage":{...}`` of the answer is the top-level one: the fields before it
(``choices``: text, token strings and tool-call arguments, all JSON strings whose quotes are
escaped) hold no such key.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

_KEY = b'"usage"'
_USAGE = re.compile(rb'"usage"\s*:\s*(\{(?:[^{}]|\{[^{}]*\})*\})')
# A usage object is a few hundred bytes: an unclosed one longer than this is not one.
MAX_USAGE_BYTES = 4096


def usage_in(text: bytes) -> dict[str, Any] | None:
    """The usage object at the start of ``text`` (``"usage": {...}``), if complete and valid."""
    match = _USAGE.match(text)
    if match is None:
        return None
    try:
        parsed = orjson.loads(match.group(1))
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


class UsageScan:
    """Feed it the answer's chunks in order; ``usage`` is set once found (then it stops)."""

    def __init__(self) -> None:
        self.usage: dict[str, Any] | None = None
        self._carry = b""  # the previous chunk's end: a usage object may start there

    def feed(self, chunk: bytes) -> None:
        if self.usage is not None:
            return
        text = self._carry + chunk if self._carry else chunk
        start = 0
        while (at := text.find(_KEY, start)) >= 0:
            # Not every "usage" key holds the usage (a completions top_logprobs entry for the
            # token "usage" is a number); one cut at the end is tried again with the rest.
            if (usage := usage_in(text[at : at + MAX_USAGE_BYTES])) is not None:
                self.usage, self._carry = usage, b""
                return
            start = at + 1
        self._carry = text[-MAX_USAGE_BYTES:]


def is_error_body(body: bytes) -> bool:
    """OpenAI's error shape, or vLLM's older flat one."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(parsed, dict) and ("error" in parsed or "message" in parsed)


def usage_of_body(body: bytes) -> dict[str, Any] | None:
    """The ``usage`` of a whole (non-stream) answer's JSON; None without one."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    usage = parsed.get("usage") if isinstance(parsed, dict) else None
    return usage if isinstance(usage, dict) else None
