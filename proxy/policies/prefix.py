"""The prompt-prefix hash that ``backends: prefix_affinity`` steers by.

vLLM's prefix cache reuses the KV of a shared leading run of tokens, so requests that begin the
same way run faster where the first one ran. The proxy has no tokenizer: the prefix is the first
``tokens`` tokens, approximated as ``tokens * chars_per_token`` characters of the prompt text
(or the first ``tokens`` ids when the prompt is given as token ids).

The hash is keyed on the request's cache salt too: vLLM never shares cached blocks between
salts, so two tenants' equal prefixes are different prefixes to the cache, and steering them to
one backend would only sharpen a timing probe of one by the other (docs/isolation.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

_SEPARATOR = "\x1e"  # between chat messages, so that ["ab", "c"] and ["a", "bc"] differ


def prefix_hash(
    body: Mapping[str, Any], *, tokens: int, chars_per_token: float, salt: str = ""
) -> int | None:
    """A 64-bit hash of (``salt``, the prompt's first ``tokens`` tokens), from a parsed chat or
    completion body; None when it holds no prompt to hash."""
    h = _prompt_hash(body, tokens=tokens, chars_per_token=chars_per_token)
    if h is None or not salt:
        return h
    return _digest(salt.encode("utf-8") + b"\x1f" + h.to_bytes(8, "big"))


def _prompt_hash(body: Mapping[str, Any], *, tokens: int, chars_per_token: float) -> int | None:
    messages = body.get("messages")
    if isinstance(messages, list):
        text = _chat_text(messages, limit=int(tokens * chars_per_token))
        return _digest(text.encode("utf-8")) if text else None
    return _completion_hash(body.get("prompt"), tokens=tokens, chars_per_token=chars_per_token)


def _completion_hash(prompt: Any, *, tokens: int, chars_per_token: float) -> int | None:
    """A completion's ``prompt``: text, token ids, or a batch of either (its first)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: the first prompt
    if isinstance(prompt, str) and prompt:
        return _digest(prompt[: int(tokens * chars_per_token)].encode("utf-8"))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt[:tokens]):
        ids = prompt[:tokens]
        return _digest(b"ids:" + ",".join(map(str, ids)).encode("ascii"))
    return None


def _chat_text(messages: list[Any], *, limit: int) -> str:
    parts: list[str] = []
    size = 0
    for message in messages:
        if size >= limit:
            break
        if not isinstance(message, Mapping):
            continue
        part = f"{message.get('role', '')}:{_content_text(message.get('content'))}{_SEPARATOR}"
        parts.append(part)
        size += len(part)
    return "".join(parts)[:limit]


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multi-part content: its text parts
        return "".join(
            p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    return ""


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
