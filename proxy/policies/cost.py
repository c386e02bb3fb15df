"""What a request costs in the fairness counters: weighted tokens."""

from __future__ import annotations

# Output tokens cost more than prompt tokens (decode steps vs one batched prefill), as in VTC.
OUTPUT_TOKEN_WEIGHT = 2.0


def weighted_tokens(prompt_tokens: float, output_tokens: float) -> float:
    return prompt_tokens + OUTPUT_TOKEN_WEIGHT * output_tokens


def work_tokens(
    prompt_tokens: float, cached_tokens: float, output_tokens: float, cached_charge: float
) -> float:
    """Weighted tokens by the work a request caused: of its prompt, the tokens found in the
    backend's prefix cache count ``cached_charge`` (0..1) each, as they skipped the prefill."""
    cached = min(cached_tokens, prompt_tokens)
    return weighted_tokens(prompt_tokens - (1.0 - cached_charge) * cached, output_tokens)
