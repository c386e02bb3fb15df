"""What comes in from a client: the API key, the JSON body, and what must not pass on.

The body's fields pass by the route's rule (``proxy.request.route_table``, its
``proxy.request.body_fields``): no client sets its priority, cache salt, session, request id or
vLLM's KV/encoder connectors; the headers that steer vLLM are dropped in
``proxy.request.headers``; only the proxy's signed ticket decides.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.api.errors import bad_request
from proxy.api.input_errors import too_deep, too_many_elements
from proxy.api.routes import BY_ENDPOINT, Endpoint
from proxy.config.scheduling import Limits, Scheduling
from proxy.config.server import InputLimits
from proxy.config.tenants import Tier
from proxy.request.body import read_body
from proxy.request.costs import lax_bool, lax_int
from proxy.request.jsonshape import (
    JsonShape,
    TooDeep,
    TooManyElements,
    measure,
    nesting_exceeds,
)
from proxy.request.route_table import ROWS, RouteRow

__all__ = [
    "BODY_READ_TIMEOUT_S",
    "Endpoint",
    "ParsedRequest",
    "nesting_exceeds",
    "parse_body",
    "read_body",
]

# The admin API's body wait (client bodies wait input.body_read_timeout_s).
BODY_READ_TIMEOUT_S = 30.0


@dataclass
class ParsedRequest:
    body: dict[str, Any]
    endpoint: Endpoint
    stream: bool
    model: str | None
    prompt_tokens: int  # estimate from characters
    max_tokens: int | None  # after the tier's clamp
    expected_output: int
    client_wants_usage: bool  # the client asked for the final usage chunk itself
    path: str = ""  # the route's path the client called (sent on unchanged); "" its first one
    held_bytes: int = 0  # what the parsed body holds in memory (an upper bound)
    # An upper bound of its prompt's tokens (prompt_bound): what quotas and budgets reserve.
    # 0: not measured (then the estimate).
    prompt_bound_tokens: int = 0
    sequences: int = 1  # generations it runs: n choices of every prompt (0: a pooling route)
    extra_choices: int = 0  # n - 1: each prompt prefilled again (``prompt_billed``)
    # Its stream's text bounds its tokens (``proxy.relay.delivered``): not where it asks for
    # logprobs, whose weight makes vLLM's API server lag and merge many engine steps into one
    # chunk, and a token may make no text (red team, stop 57: 153,731 tokens run, 1,155 billed).
    text_bounds_tokens: bool = True
    budget_from_client: bool = True  # the client set max_tokens (else the proxy, or none)

    @property
    def prompt_upper_bound(self) -> int:
        return max(self.prompt_bound_tokens, self.prompt_tokens)

    def prompt_billed(self, prompt: int) -> int:
        """``prompt`` (as its usage or its bound says it) once for each choice: vLLM runs a
        request per choice of an ``n`` > 1 request and counts the prompt for each in its own
        ``vllm:prompt_tokens_total``, while its usage says it once. Each copy prefills its
        prompt's last block with prefix caching, all of it without, or with
        ``prompt_logprobs`` (the cache bypassed: red team, 2026-12-06, 447,360 prompt tokens
        run, 3,495 billed)."""
        return prompt * (1 + self.extra_choices)

    @property
    def output_upper_bound(self) -> int | None:
        """The most output tokens vLLM may generate for it (every sequence to its
        max_tokens); 0 on the routes that generate nothing; None when nothing bounds it but
        the model's context (no max_tokens from the client, the tier or the proxy)."""
        if not self.sequences:
            return 0
        return None if self.max_tokens is None else self.max_tokens * self.sequences

    def keep_output_within(self, context: int) -> None:
        """The output budget kept within the model's ``context`` (its ``max_model_len``),
        which vLLM's generating routes refuse to pass: one the proxy set (a tier's cap, a
        share of tokens_per_minute) is lowered to it; one the client set past it gets vLLM's
        refusal (400)."""
        fields = ROWS[self.endpoint].budget_fields
        if not fields or self.max_tokens is None or self.max_tokens <= context:
            return
        if not self.budget_from_client:
            for name in fields:
                if name in self.body:
                    self.body[name] = context
            self.max_tokens = context
            return
        name = _budget_field(self.body, fields)
        raise bad_request(
            f"{name}={self.max_tokens} cannot be greater than max_model_len={context}. Please"
            f" request fewer output tokens. (parameter={name}, value={self.max_tokens})",
            param=name,
        )

    @property
    def upstream_path(self) -> str:
        return self.path or BY_ENDPOINT[self.endpoint].paths[0]


_DEFAULT_INPUTS = InputLimits()


def parse_body(
    raw: bytes,
    endpoint: Endpoint,
    tier: Tier,
    limits: Limits,
    scheduling: Scheduling,
    *,
    max_depth: int | None = None,
    path: str = "",
    token_limit: float | None = None,
    inputs: InputLimits | None = None,
) -> ParsedRequest:
    """Validate a body and estimate its cost; 400 for what no backend could run. A ``null``
    top-level field counts as absent, as in OpenAI's API; numbers and booleans sent as strings
    are read as vLLM's pydantic models read them. ``token_limit``: the tenant's
    tokens_per_minute, which also caps each sequence of a request that sets no max_tokens.
    ``inputs`` bounds the body's shape (``max_depth`` overrides its depth)."""
    inputs = inputs or _DEFAULT_INPUTS
    if max_depth is not None:
        inputs = inputs.model_copy(update={"max_json_depth": max_depth})
    body, shape = _decode_object(raw, inputs)
    route, row = BY_ENDPOINT[endpoint], ROWS[endpoint]
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    stream = _lax_field(body, "stream", lax_bool, "a boolean")
    stream = bool(stream) and route.generates  # the pooling routes never stream
    chars = row.measure(body)
    bound = row.bound(body, len(raw), inputs.max_tokens_per_media_item)
    row.fields.apply(body)
    from_client = any(name in body for name in row.budget_fields)
    max_tokens, expected = (
        _output_budget(body, row, tier, limits, scheduling, from_client, token_limit)
        if route.generates
        else (None, 0)
    )
    choices = _choices(body, row) if route.generates else 0  # of each prompt
    return ParsedRequest(
        body=body,
        endpoint=endpoint,
        stream=stream,
        model=model,
        prompt_tokens=max(1, math.ceil(chars / scheduling.chars_per_token)),
        max_tokens=max_tokens,
        expected_output=expected,
        client_wants_usage=_ask_for_usage(body, row, stream),
        path=path,
        held_bytes=shape.held_bytes(raw),
        prompt_bound_tokens=bound,
        sequences=choices * row.generations(body),
        extra_choices=max(0, choices - 1),
        text_bounds_tokens=not _asks_logprobs(body),
        budget_from_client=from_client,
    )


def _decode_object(raw: bytes, inputs: InputLimits) -> tuple[dict[str, Any], JsonShape]:
    """The body as a JSON object, its null fields dropped, and its shape; 400 past the
    input's bounds on nesting and on the number of values (checked in one pass, before any
    other step walks the body)."""
    max_depth = inputs.max_json_depth
    try:
        loaded = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "depth" in str(exc):  # orjson's own limit (1024), far past ours
            raise too_deep(max_depth) from None
        raise bad_request(f"The body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(loaded, dict):
        raise bad_request("The body must be a JSON object", code="invalid_json")
    try:
        shape = measure(
            loaded,
            max_depth=max_depth,
            max_elements=inputs.max_json_elements,
            max_containers=inputs.max_json_containers,
        )
    except TooDeep:
        raise too_deep(max_depth) from None
    except TooManyElements as exc:
        knob = "max_json_elements" if exc.what == "values" else "max_json_containers"
        raise too_many_elements(exc.what, exc.limit, knob) from None
    return {k: v for k, v in loaded.items() if v is not None}, shape


def _output_budget(
    body: dict[str, Any],
    row: RouteRow,
    tier: Tier,
    limits: Limits,
    scheduling: Scheduling,
    client_set: bool,
    token_limit: float | None = None,
) -> tuple[int | None, int]:
    """(max_tokens as sent on, clamped to the tier; output tokens expected from all n
    choices of every prompt) of a generating request (``client_set``: its body sets one)."""
    fields = row.budget_fields
    max_tokens = _clamped_max_tokens(body, tier, limits, fields, row.default_max_tokens)
    n = _lax_field(body, "n", lax_int, "an integer") if row.choices else None
    n = 1 if n is None else n
    if n < 1 or n > 128:
        raise bad_request("'n' must be an integer between 1 and 128", param="n")
    expected = max_tokens if max_tokens is not None else scheduling.default_expected_output
    if tier.max_tokens is not None:
        expected = min(expected, tier.max_tokens)
    prompts = row.generations(body)
    if token_limit is not None and not client_set:
        # Without max_tokens vLLM runs to the context's end (or the tier's cap), past what the
        # tenant's whole tokens_per_minute allows, and debt past one minute is forgiven: each
        # sequence gets at most its share of the limit (vLLM still stops at the context's end).
        share = max(1, int(token_limit // (n * prompts)))
        if max_tokens is None or max_tokens > share:
            max_tokens = body[fields[0]] = share
        expected = min(expected, share)
    return max_tokens, int(expected * n * prompts)


def _asks_logprobs(body: dict[str, Any]) -> bool:
    """Whether vLLM sends logprobs with each token (chat: ``logprobs: true``, completions: a
    number, 0 included; either's ``top_logprobs``)."""
    return body.get("logprobs", False) is not False or bool(body.get("top_logprobs"))


def _choices(body: dict[str, Any], row: RouteRow) -> int:
    """The choices it runs of each prompt: ``n`` (read and checked by ``_output_budget``) where
    vLLM's model has it, else one."""
    n = body.get("n", 1) if row.choices else 1
    return n if isinstance(n, int) else 1


def _ask_for_usage(body: dict[str, Any], row: RouteRow, stream: bool) -> bool:
    """Whether the client asked for a stream's usage; the body asks vLLM for it anyway
    (fairness and metrics count real tokens; the relay drops the chunk again if unasked).
    The Responses API always ends its stream with the usage (in response.completed)."""
    if row.usage_always:
        return True
    if not stream:
        return False
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", param="stream_options")
    options = dict(options or {})
    wants = bool(lax_bool(options.get("include_usage")))
    options["include_usage"] = True
    body["stream_options"] = options
    return wants


def _lax_field(body: dict[str, Any], name: str, read: Callable[[object], Any], kind: str) -> Any:
    """The field read as vLLM reads it, written back in its plain type; 400 when vLLM would
    refuse it too; None when absent."""
    if name not in body:
        return None
    value = read(body[name])
    if value is None:
        raise bad_request(f"'{name}' must be {kind}", param=name)
    body[name] = value
    return value


_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


def _budget_field(body: dict[str, Any], fields: tuple[str, ...]) -> str:
    """The budget field vLLM reads of those ``body`` sets: the last (chat's
    ``max_completion_tokens`` over ``max_tokens``)."""
    return [f for f in fields if body.get(f) is not None][-1]


def _clamped_max_tokens(
    body: dict[str, Any],
    tier: Tier,
    limits: Limits,
    fields: tuple[str, ...] = _TOKEN_FIELDS,
    default: int | None = None,
) -> int | None:
    """Validate the output budget fields and clamp them to the tier's cap. Of two fields the
    last one set is the bound: vLLM's chat takes ``max_completion_tokens`` over ``max_tokens``
    whatever their sizes (``build_tok_params``; a small ``max_tokens`` beside it reserved 1 and
    ran 2,000, and the larger of the two refused a ``max_tokens`` vLLM ignores). None set:
    the route's ``default`` (vLLM's, not written into the body unless the tier's cap is lower),
    else None (to the context's end)."""
    chosen: int | None = None
    for name in fields:
        value = _lax_field(body, name, lax_int, "a positive integer")
        if value is None:
            continue
        if value < 1:
            raise bad_request(f"'{name}' must be a positive integer", param=name)
        chosen = value
    if chosen is not None and chosen > limits.max_tokens_ceiling:
        name = _budget_field(body, fields)
        raise bad_request(
            f"'{name}' is {chosen}; the most this service allows is {limits.max_tokens_ceiling}",
            param=name,
        )
    if chosen is None and default is not None:
        if tier.max_tokens is None or tier.max_tokens >= default:
            return default
        chosen = body[fields[0]] = tier.max_tokens
        return chosen
    if tier.max_tokens is not None:
        if chosen is None or chosen > tier.max_tokens:
            chosen = tier.max_tokens
        for name in fields:
            if name in body:
                body[name] = min(body[name], chosen)
        if not any(name in body for name in fields):
            body[fields[0]] = chosen
    return chosen
