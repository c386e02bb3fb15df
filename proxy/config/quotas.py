"""`quota:` (tokens and money per day and per month, on a tier or a tenant) and `pricing:`
(per model, per million tokens), with the cost arithmetic both the quotas and the usage log use.

Periods are UTC calendar days and months: one boundary for every replica and every operator,
whatever the hosts' time zones (docs/quotas.md)."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from pydantic import Field

from proxy.config.base import Strict

PER = 1_000_000  # prices are per million tokens


class Quota(Strict):
    """Tokens and money a tenant may use per UTC day and per UTC calendar month. Checked before
    a request runs against its worst case (the prompt's upper bound plus max_tokens for each
    choice, priced as uncached input), corrected to what the engine ran when it ends; refused
    with 429 `quota_exceeded` / `budget_exceeded` and a Retry-After to the period's reset."""

    tokens_per_day: float | None = Field(
        None, gt=0, description="Prompt + output tokens per UTC day; null: no daily quota."
    )
    tokens_per_month: float | None = Field(
        None,
        gt=0,
        description="Prompt + output tokens per UTC calendar month; null: no monthly quota.",
    )
    budget_per_day: float | None = Field(
        None,
        gt=0,
        description="Money per UTC day, in the currency of `pricing` (a request to a model"
        " without a price is refused: 400 `model_not_priced`); null: no daily budget.",
    )
    budget_per_month: float | None = Field(
        None,
        gt=0,
        description="Money per UTC calendar month, in the currency of `pricing`; null: no"
        " monthly budget.",
    )

    def limits(self) -> dict[str, float]:
        """The quotas set, by their name (tokens_per_day, ..., budget_per_month)."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class Price(Strict):
    """What one model's tokens cost, per million tokens, in one currency of your choice."""

    input: float = Field(ge=0, description="Per million prompt tokens not served from cache.")
    cached_input: float | None = Field(
        None,
        ge=0,
        description="Per million prompt tokens vLLM served from its prefix cache (its"
        " usage.prompt_tokens_details.cached_tokens, reported when vLLM runs with"
        " --enable-prompt-tokens-details); null: the input price.",
    )
    output: float = Field(ge=0, description="Per million output tokens.")

    def cost(self, prompt: float, cached: float, completion: float) -> float:
        cached = min(max(cached, 0.0), prompt)
        cached_price = self.input if self.cached_input is None else self.cached_input
        fresh = prompt - cached
        return (fresh * self.input + cached * cached_price + completion * self.output) / PER

    def worst_case(self, prompt: float, completion: float) -> float:
        """Before the answer: no cache hit assumed, every allowed output token produced."""
        return self.cost(prompt, 0.0, completion)


def price_of(pricing: Mapping[str, Price], model: str | None) -> Price | None:
    """The model's price: its exact name, else the first glob (`llama-*`, `*`) that matches, in
    the table's order; None when none does (the request costs nothing)."""
    if model is None:
        return None
    exact = pricing.get(model)
    if exact is not None:
        return exact
    for pattern, price in pricing.items():
        if fnmatch.fnmatchcase(model, pattern):
            return price
    return None
