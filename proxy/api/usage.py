"""The one reading of a backend's ``usage`` object, whatever route answered: chat, completions
and embeddings name their counts ``prompt_tokens``/``completion_tokens``, the Responses API
``input_tokens``/``output_tokens``, rerank only ``total_tokens``. Everything that counts
tokens (tenant token limits and their refunds, the per-tenant counters and usage log, metrics,
fairness, the SLO's ITL) reads them through here, so no route is billed 0/0."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

_NAMES = (("prompt_tokens", "completion_tokens"), ("input_tokens", "output_tokens"))


@dataclass(frozen=True, slots=True)
class TokenUsage:
    prompt: int  # input tokens
    completion: int  # output tokens
    total: int  # what the backend says it used: its total_tokens, else the sum
    # Of ``prompt``, the tokens vLLM found in its prefix cache (0 unless it runs with
    # --enable-prompt-tokens-details and says so).
    cached: int = 0


def token_usage(usage: Mapping[str, Any] | None) -> TokenUsage | None:
    """The counts of ``usage`` (an answer's usage object), or None when it says nothing."""
    if not usage:
        return None
    total = usage.get("total_tokens")
    for prompt_key, output_key in _NAMES:
        prompt = usage.get(prompt_key)
        if is_count(prompt):
            output = usage.get(output_key)
            completion = output if is_count(output) else 0
            used = total if is_count(total) else prompt + completion
            return TokenUsage(prompt, completion, used, min(cached_tokens(usage), prompt))
    return TokenUsage(total, 0, total) if is_count(total) else None


def is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def cached_tokens(usage: Mapping[str, Any] | None) -> int:
    """Prompt tokens served from vLLM's prefix cache: ``prompt_tokens_details.cached_tokens``
    (``input_tokens_details`` on the Responses API); 0 when not reported (vLLM reports it only
    with ``--enable-prompt-tokens-details``)."""
    if not usage:
        return 0
    for key in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(key)
        if isinstance(details, Mapping) and is_count(cached := details.get("cached_tokens")):
            return cached
    return 0
