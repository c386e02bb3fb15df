"""What a request costs in the fairness counters: weighted tokens."""

from __future__ import annotations

# Output tokens cost more than prompt tokens (decode steps vs one batched prefill), as in VTC.
OUTPUT_TOKEN_WEIGHT = 2.0


def weighted_tokens(prompt_tokens: float, output_tokens: float) -> float:
    return prompt_tokens + OUTPUT_TOKEN_WEIGHT * output_tokens
