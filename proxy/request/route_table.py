"""One row per route: everything that differs between vLLM's routes, written once, beside the
route (``proxy.api.routes`` names them). Parsing, the prompt's bound, the output budget, the
prefix-cache index, the relay and the body's fields read the row; no ``endpoint ==`` branch
elsewhere. mypy and tests/unit/request/test_route_table.py keep a row for every ``Endpoint``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from proxy.api.routes import Endpoint
from proxy.relay.forward import RelayResult, UpstreamCall, relay
from proxy.relay.responses import relay_responses
from proxy.request import body_fields, costs, kv_prompt
from proxy.request.body_fields import BodyFields
from proxy.request.kv_prompt import KvPrompt
from proxy.request.prompt_bound import Bound, linear_bound, pairwise_bound


class Relay(Protocol):
    """The upstream call and the relay of its answer (``proxy.relay.forward.relay``)."""

    async def __call__(
        self, call: UpstreamCall, request: web.Request, *, stream: bool, now: Callable[[], float]
    ) -> RelayResult: ...


def one_generation(body: dict[str, Any]) -> int:
    return 1


def completion_generations(body: dict[str, Any]) -> int:
    """vLLM runs every prompt of a completions prompt list (strings or token-id lists; a flat
    token-id list is one), and every one of its ``prompt_embeds`` besides (a list or one)."""
    prompt = body.get("prompt")
    runs = 1
    if isinstance(prompt, list) and prompt and not costs._is_int(prompt[0]):
        runs = len(prompt)
    embeds = body.get("prompt_embeds")
    if embeds is not None:
        runs += len(embeds) if isinstance(embeds, list) else 1
    return runs


@dataclass(frozen=True)
class RouteRow:
    measure: Callable[[dict[str, Any]], int]  # validates the input; its characters (a guess)
    bound: Bound  # an upper bound of its prompt's tokens (proxy.request.prompt_bound)
    fields: BodyFields  # which body fields go on to vLLM (proxy.request.body_fields)
    # The output budget's fields, the first set by the proxy; () where nothing is generated.
    budget_fields: tuple[str, ...] = ()
    generations: Callable[[dict[str, Any]], int] = one_generation  # runs of ``n`` choices
    usage_always: bool = False  # its stream ends with the usage whatever the client asked
    kv_prompt: KvPrompt | None = None  # its prompt for the prefix-cache index; None: none
    relay: Relay = relay  # how its answer comes back
    proxy_request_id: bool = True  # vLLM's model has ``request_id``: the proxy's id goes in it
    stored_responses_refused: bool = False  # ``store`` must be false (proxy.request.stored)
    # vLLM's output budget where the body sets none (completions: 16); None: to the context's end.
    default_max_tokens: int | None = None
    # vLLM's model runs ``n`` choices (chat, completions); its Responses model has no ``n`` and
    # runs one whatever the body says (red team, stop 57: billed 3x what ran, and refused).
    choices: bool = True


_TOKENS = ("max_tokens", "max_completion_tokens")

ROWS: Mapping[Endpoint, RouteRow] = {
    "chat": RouteRow(
        costs.chat_chars,
        linear_bound,
        BodyFields(body_fields.CHAT),
        budget_fields=_TOKENS,
        kv_prompt=kv_prompt.CHAT,
    ),
    "completions": RouteRow(
        costs.completion_chars,
        linear_bound,
        BodyFields(body_fields.COMPLETIONS),
        budget_fields=("max_tokens",),  # vLLM's completions have no max_completion_tokens
        default_max_tokens=16,  # vLLM's CompletionRequest
        generations=completion_generations,
        kv_prompt=kv_prompt.COMPLETION,
    ),
    "responses": RouteRow(
        costs.responses_chars,
        linear_bound,
        BodyFields(body_fields.RESPONSES),
        budget_fields=("max_output_tokens",),
        usage_always=True,
        relay=relay_responses,  # events of its own kind
        stored_responses_refused=True,
        choices=False,
    ),
    "embeddings": RouteRow(costs.pooled_input_chars, linear_bound, BodyFields(body_fields.POOLED)),
    "pooling": RouteRow(costs.pooled_input_chars, linear_bound, BodyFields(body_fields.POOLED)),
    "classify": RouteRow(costs.pooled_input_chars, linear_bound, BodyFields(body_fields.POOLED)),
    "score": RouteRow(costs.score_chars, pairwise_bound, BodyFields(body_fields.SCORE)),
    "rerank": RouteRow(costs.rerank_chars, pairwise_bound, BodyFields(body_fields.SCORE)),
    "tokenize": RouteRow(
        costs.tokenize_chars,
        linear_bound,
        BodyFields(body_fields.TOKENIZE),
        proxy_request_id=False,
    ),
    "detokenize": RouteRow(
        costs.detokenize_chars,
        linear_bound,
        BodyFields(body_fields.DETOKENIZE),
        proxy_request_id=False,
    ),
}
