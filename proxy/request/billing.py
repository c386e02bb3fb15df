"""What a request is billed as before it runs: the model vLLM will run for it, that model's
price, and the most output it may generate (docs/quotas.md, "What cannot be priced").

vLLM runs its default model (its first served name) for a request without ``model``: such a
request is priced as that model, never as free. The backends' ``/v1/models`` cards (probed,
never fetched per request) say which model that is and its context (``max_model_len``), the
most a sequence can ever hold when nothing else bounds its output.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from proxy.api.quota_counters import COUNTERS
from proxy.config.quotas import Price, price_of

Card = Mapping[str, object]


@dataclass(frozen=True)
class Billed:
    model: str | None  # the model billed: the request's own, else the backends' default
    price: Price | None  # None: no price applies (free, or refused where a budget needs one)


def default_models(cards_by_backend: Iterable[Sequence[Card]]) -> list[str]:
    """Each backend's default model: its first base-model card (LoRA adapters list a
    ``parent``), in backend order, without repeats."""
    names: list[str] = []
    for cards in cards_by_backend:
        for card in cards:
            if card.get("parent") is None and isinstance(card.get("id"), str):
                name = str(card["id"])
                if name not in names:
                    names.append(name)
                break
    return names


def billed_as(model: str | None, pricing: Mapping[str, Price], defaults: Sequence[str]) -> Billed:
    """The request's own model and its price; without one, the backends' default model at
    the highest price among them (backends that disagree: the reservation is a bound), else
    the ``"*"`` price."""
    if model is not None:
        return Billed(model, price_of(pricing, model))
    priced = [(name, price_of(pricing, name)) for name in defaults]
    best = max(
        ((name, price) for name, price in priced if price is not None),
        key=lambda item: (item[1].input, item[1].output),
        default=None,
    )
    if best is not None:
        return Billed(*best)
    return Billed(defaults[0] if defaults else None, pricing.get("*"))


def model_context(model: str | None, cards_by_backend: Iterable[Sequence[Card]]) -> int | None:
    """The largest ``max_model_len`` any backend reports for ``model``, a LoRA adapter's
    being its base model's (vLLM lists an adapter's card with a ``parent`` and no
    ``max_model_len``); None when none does."""
    contexts: list[int] = []
    for cards in cards_by_backend:
        # Only string ids and parents: a backend's card is not trusted to be well formed.
        by_id = {card["id"]: card for card in cards if isinstance(card.get("id"), str)}
        card = by_id.get(model) if model is not None else None
        if card is not None and card.get("max_model_len") is None:
            parent = card.get("parent")
            card = by_id.get(parent) if isinstance(parent, str) else None
        length = card.get("max_model_len") if card is not None else None
        if isinstance(length, int) and not isinstance(length, bool) and length > 0:
            contexts.append(length)
    return max(contexts, default=None)


def affordable_output(
    limits: Mapping[str, float],
    used: Mapping[str, float],
    *,
    prompt: float,
    price: Price | None,
    sequences: int,
) -> int | None:
    """Output tokens per sequence that the tenant's remaining quotas still pay for after the
    prompt (the smallest over its counters); None when no counter bounds it."""
    per_sequence: float | None = None
    for counter, limit in limits.items():
        left = limit - used.get(counter, 0.0)
        if COUNTERS[counter].measure == "tokens":
            room = (left - prompt) / sequences
        elif price is not None and price.output > 0:
            room = (left - price.worst_case(prompt, 0.0)) / (price.worst_case(0.0, 1.0) * sequences)
        else:
            continue
        per_sequence = room if per_sequence is None else min(per_sequence, room)
    return None if per_sequence is None else int(per_sequence)
